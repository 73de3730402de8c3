"""The grid-wide gradient norm of a tensor-parallel model weighs its replicated parameters by their
reduced gradients, which NVMe offload keeps in its master store, not in memory: with gradient
clipping or fp16 (which need that norm) initialize refuses the set, naming its features, instead
of the first step failing; without them the model trains."""
from __future__ import annotations

import pytest

pytest.importorskip("zkit_offload")
pytest.importorskip("zkit_pipeline")

import grid_norm_offload_ranks  # noqa: E402
from zkit.testing import run_ranks  # noqa: E402

REFUSAL = ("the global gradient norm of a tensor-parallel model or of weights tied across pipeline stages "
           "(gradient clipping, fp16's overflow check) reads each parameter's reduced gradient, which "
           "zero_optimization.offload_optimizer.device 'nvme' keeps in its master store")


@pytest.mark.parametrize("features", [("clipping",), ("fp16",), ()], ids=["clipping", "fp16", "neither"])
def test_tensor_parallel_nvme_norm(tmp_path, features):
    for got in run_ranks(grid_norm_offload_ranks.tensor_parallel_nvme, 2, args=(features, str(tmp_path)),
                         timeout=300):
        if features:
            assert got["refused"].startswith(REFUSAL), got
        else:
            assert got == {"trained": 1}


def test_a_norm_asked_for_after_initialize_stops_at_the_step_naming_why(tmp_path):
    """``engine.track_grad_norm`` is set after initialize, so only the step can refuse it."""
    for got in run_ranks(grid_norm_offload_ranks.tensor_parallel_nvme, 2, args=((), str(tmp_path), True),
                         timeout=300):
        assert got["stopped"].startswith(
            "engine.track_grad_norm asks for the global gradient norm of a tensor-parallel model or of weights tied "
            "across pipeline stages, which reads each parameter's reduced gradient"), got
