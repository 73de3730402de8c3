"""Multi-rank training with every stage equals single-process PyTorch on the same global batch."""
import pytest
import torch

from zkit.testing import run_ranks

import engine_ranks as er

STAGES = (0, 1, 2)


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def two_rank_results():
    cases = [(s, d, g) for s in STAGES for d in ("fp32", "bf16", "fp16") for g in (1, 3)]
    return run_ranks(er.stage_matrix, 2, args=(cases,), timeout=600)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("gas", (1, 3))
def test_fp32_matches_single_process_torch(two_rank_results, stage, gas):
    ref = er.reference(3, gas, 2)
    for rank_result in two_rank_results:
        params, losses, _ = rank_result[(stage, "fp32", gas)]
        assert _max_diff(params, ref) < 1e-5
    # every rank ends with identical parameters
    assert _max_diff(two_rank_results[0][(stage, "fp32", gas)][0], two_rank_results[1][(stage, "fp32", gas)][0]) == 0


@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("dtype", ("bf16", "fp16"))
@pytest.mark.parametrize("gas", (1, 3))
def test_low_precision_stages_match_stage0(two_rank_results, stage, dtype, gas):
    base_params, base_losses, _ = two_rank_results[0][(0, dtype, gas)]
    params, losses, _ = two_rank_results[0][(stage, dtype, gas)]
    tol = 2e-2 if dtype == "bf16" else 2e-3
    assert _max_diff(params, base_params) < tol
    assert losses == pytest.approx(base_losses, rel=tol)
    # and low precision tracks fp32
    fp32_params = two_rank_results[0][(0, "fp32", gas)][0]
    assert _max_diff(params, fp32_params) < 5e-2


def test_communication_volume_per_stage(two_rank_results):
    """Stage 0 all-reduces; stages 1 and 2 reduce-scatter and all-gather the same bytes."""
    s0 = two_rank_results[0][(0, "fp32", 1)][2]
    s1 = two_rank_results[0][(1, "fp32", 1)][2]
    s2 = two_rank_results[0][(2, "fp32", 3)][2]
    assert set(s0) == {"all_reduce"}
    # one 4-byte all-reduce per step (3 steps) agrees on a non-finite loss (no norm is computed)
    flags = 3 * 4
    assert s1["reduce_scatter"]["bytes"] + s1["all_gather"]["bytes"] == s0["all_reduce"]["bytes"] - flags
    assert s1["all_reduce"]["bytes"] == flags
    # stage 2 reduces at every micro-step: 3 micro-steps per step
    assert s2["reduce_scatter"]["calls"] == 3 * s1["reduce_scatter"]["calls"]


def test_four_ranks_stage2_matches_torch():
    results = run_ranks(er.stage_matrix, 4, args=([(2, "fp32", 2), (1, "fp32", 1)],), timeout=600)
    for stage, gas in ((2, 2), (1, 1)):
        ref = er.reference(3, gas, 4)
        for r in results:
            assert _max_diff(r[(stage, "fp32", gas)][0], ref) < 1e-5


@pytest.mark.parametrize("stage", (0, 2))
def test_gradient_clipping_matches_torch(stage):
    results = run_ranks(er.clipped, 2, args=(0.05, stage), timeout=300)
    ref = er.reference(3, 1, 2, clip=0.05)
    assert _max_diff(results[0], ref) < 1e-5


def test_fp16_overflow_on_one_rank_skips_everywhere():
    results = run_ranks(er.fp16_overflow, 2, timeout=300)
    for r in results:
        assert r["applied"] is False and r["skipped"] == 1 and r["unchanged"]
        assert r["scale_after"] == r["scale_before"] / 2


def test_overlapped_parameter_gather_matches_torch():
    """overlap_param_gather defers the all-gathers to the next forward: same numbers as torch."""
    cases = [(1, "fp32", 1), (2, "fp32", 3), (1, "bf16", 1), (2, "bf16", 1)]
    results = run_ranks(er.overlapped_param_gather, 2, args=(cases,), timeout=600)
    for stage, gas in ((1, 1), (2, 3)):
        ref = er.reference(3, gas, 2)
        for rank_result in results:
            params, _, in_flight = rank_result[(stage, "fp32", gas)]
            assert in_flight, "the last step's all-gathers should still be in flight after step()"
            assert _max_diff(params, ref) < 1e-5
    plain = run_ranks(er.stage_matrix, 2, args=([(1, "bf16", 1), (2, "bf16", 1)],), timeout=600)
    for stage in (1, 2):
        assert _max_diff(results[0][(stage, "bf16", 1)][0], plain[0][(stage, "bf16", 1)][0]) == 0


def test_overlapped_parameter_gather_readers_wait():
    seen = run_ranks(er.overlapped_gather_readers, 2, timeout=300)[0]
    for reader, (before, after) in seen.items():
        assert before and not after, reader
