"""A pipeline stage whose parameters are all frozen trains, as in DeepSpeed: it runs forward and
backward, passing gradients to the stages before it, and equals the same layers frozen alike in
one process, under ZeRO 0-2, with and without gradient clipping, on 2 stages (x 2 replicas). A
pipeline frozen on every stage, and ZeRO stage 3, are refused on every rank at initialize."""
from __future__ import annotations

import pytest

import frozen_stage_ranks as fsr
from zkit.testing import run_ranks

CLIP = 0.05  # below the gradient norms of this model: clipping applies at every step
TWO_RANKS = [(frozen, zero, clip) for frozen in (0, 1) for zero in (0, 1, 2) for clip in (0.0, CLIP)]
FOUR_RANKS = [(0, 2, CLIP), (1, 1, 0.0)]  # 2 stages x 2 replicas
STAGE3 = [(0, 3, 0.0), (1, 3, 0.0)]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(fsr.frozen_stage_runs, 2, args=(TWO_RANKS + STAGE3,), timeout=300)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(fsr.frozen_stage_runs, 4, args=(FOUR_RANKS,), timeout=300)


def _check(results, case):
    for rank, by_case in enumerate(results):
        r = by_case[case]
        assert "refused" not in r, (rank, r)
        assert r["global_steps"] == 3
        assert (r["trainable"] == 0) == (r["layers"][0] == fsr.STAGE_LAYERS[case[0]][0]), rank
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), rank
        assert r["param_diff"] < 1e-6, rank
        if case[2]:  # the clipping norm covers the stage that trains, and is the same everywhere
            assert r["grad_norm"] == pytest.approx(results[0][case]["grad_norm"]) and r["grad_norm"] > CLIP


@pytest.mark.parametrize("case", TWO_RANKS, ids=lambda c: f"frozen{c[0]}-zero{c[1]}{'-clip' if c[2] else ''}")
def test_a_frozen_stage_trains_like_one_process(two_ranks, case):
    _check(two_ranks, case)


@pytest.mark.parametrize("case", FOUR_RANKS, ids=lambda c: f"frozen{c[0]}-zero{c[1]}{'-clip' if c[2] else ''}")
def test_a_frozen_stage_with_two_replicas_trains_like_one_process(four_ranks, case):
    _check(four_ranks, case)


def test_refusals_come_on_every_rank(two_ranks, four_ranks):
    for world, results in ((2, two_ranks), (4, four_ranks)):
        for by_case in results:
            assert by_case["all"] == (f"the model has no trainable parameters (requires_grad=True) on any of its "
                                      f"{world} ranks (PipelineModule): nothing to train")
    for by_case in two_ranks:
        for case in STAGE3:  # the frozen stage's rank says the same as the other
            assert "ZeRO stage 3 is not supported with pipeline parallelism" in by_case[case]["refused"]
