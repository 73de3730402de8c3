"""``engine.train_batch`` of a PipelineModule through zkit's engine and ZeRO partitioners: the
partitioner reduces over the stage's data-parallel replicas only, and training equals
single-process training of the same layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pp_engine_ranks as per
from zkit.testing import run_ranks
from zkit_pipeline import PipelineModule

TWO_RANK_CASES = [
    (0, "1f1b", False), (1, "1f1b", False), (2, "1f1b", False), (1, "1f1b", True), (0, "zb_h1", True),
    (2, "interleaved_1f1b", False), (2, "zb_h1", False), (1, "1f1b", "clip"), (0, "1f1b", "tied-clip"),
]
FOUR_RANK_CASES = [
    (0, "1f1b", False), (1, "1f1b", False), (2, "1f1b", False), (1, "1f1b", True), (1, "zb_h1", False),
    (2, "1f1b", "clip"),
]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(per.two_ranks, 2, timeout=240)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(per.four_ranks, 4, timeout=240)


def _check(results, case, dp):
    for rank, by_case in enumerate(results):
        r = by_case[case]
        assert r["dp_size"] == dp, f"rank {rank}"
        assert r["train_batch_size"] == per.BATCH * per.MICRO * dp
        assert r["global_steps"] == per.STEPS
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), f"rank {rank}"
        assert not r["loss_requires_grad"], f"rank {rank}: train_batch returned a loss that requires grad"
        assert r["param_diff"] < 1e-5, f"rank {rank}: parameters differ by {r['param_diff']}"
        # activations and gradients cross stages on the world communicator, not the partitioner's
        assert r["world_comm"]["send"]["bytes"] > 0


@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}{'-' + ('tied' if c[2] is True else c[2]) if c[2] else ''}")
def test_two_stages_match_single_process(two_ranks, case):
    _check(two_ranks, case, dp=1)
    for by_case in two_ranks:
        # one replica per stage: the partitioner has nobody to reduce with
        assert not any(k in by_case[case]["dp_comm"] for k in ("all_reduce", "reduce_scatter"))


@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=lambda c: f"zero{c[0]}-{c[1]}{'-' + ('tied' if c[2] is True else c[2]) if c[2] else ''}")
def test_two_stages_by_two_replicas_match_single_process(four_ranks, case):
    _check(four_ranks, case, dp=2)
    stage = case[0]
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    for by_case in four_ranks:
        assert by_case[case]["dp_comm"][kind]["bytes"] > 0


def test_clipping_uses_the_norm_of_the_whole_model(two_ranks, four_ranks):
    """Both stages see the same global norm (the clipped runs above match torch's clip_grad_norm_)."""
    for results, case in ((two_ranks, (1, "1f1b", "clip")), (four_ranks, (2, "1f1b", "clip")),
                          (two_ranks, (0, "1f1b", "tied-clip"))):
        norms = [r[case]["grad_norm"] for r in results]
        assert norms[0] > per.CLIP and norms == pytest.approx([norms[0]] * len(norms), rel=1e-6)


def test_stage_two_refuses_weights_tied_across_stages(two_ranks):
    for by_case in two_ranks:
        assert "ZeRO stage 2 with a TiedLayerSpec shared by several pipeline stages is not supported" in by_case["stage2_ties"]


def test_stage_id_is_required_without_torch_distributed():
    with pytest.raises(ValueError, match="stage_id is required when torch.distributed is not initialised"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], 2, F.mse_loss)


def test_topology_needs_torch_distributed():
    from zkit_pipeline.topology import ProcessGrid

    with pytest.raises(ValueError, match="topology= needs torch.distributed to be initialised"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], 2, F.mse_loss, stage_id=0,
                       topology=ProcessGrid(pipe=2, world_size=2))


def test_single_process_module_has_no_data_parallel_group():
    mod = PipelineModule([nn.Linear(2, 2)], 1, F.mse_loss, stage_id=0)
    assert mod.data_parallel_group is None and mod.grid is None
    assert torch.equal(mod(torch.ones(1, 2)), mod.chunks[0][0](torch.ones(1, 2)))
