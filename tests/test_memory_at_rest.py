"""Between steps a rank holds no gradient memory its stage does not need: live tensor bytes
(walked from the garbage collector, not the allocator's counters) after a step stay within the
model-state formula of each stage, at or below DeepSpeed's on the same model
(``contrib/bench/bench_memory_at_rest.py`` measures both side by side)."""
from __future__ import annotations

import pytest
import torch

from tests.memory_ranks import live_bytes_after_steps
from zkit.telemetry.live_tensors import live_tensor_bytes
from zkit.testing import run_ranks

# Bytes per parameter at rest on 2 ranks (Adam: two fp32 states): parameters, plus the fp32 master
# (bf16), plus the optimizer state and master over the stage's shard. No gradients, no buckets.
AT_REST = {
    "fp32": {0: 4 + 8, 1: 4 + 8 / 2, 2: 4 + 8 / 2, 3: 4 / 2 + 8 / 2},
    "bf16": {0: 2 + 12, 1: 2 + 12 / 2, 2: 2 + 12 / 2, 3: 2 / 2 + 12 / 2},
}
SLACK = 32 * 1024  # buffers (position ids), RNG and step counters


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_no_gradient_memory_between_steps(dtype):
    per_rank = run_ranks(live_bytes_after_steps, world_size=2, args=([0, 1, 2, 3], dtype), timeout=300)
    for rank, out in enumerate(per_rank):
        for stage, (psi, live) in out.items():
            bound = AT_REST[dtype][stage] * psi + SLACK
            assert live <= bound, (
                f"rank {rank}, stage {stage}, {dtype}: {live} live bytes after a step "
                f"({live / psi:.2f} per parameter), more than the {AT_REST[dtype][stage]} per parameter at rest"
            )


def test_fake_tensors_a_compiled_checkpoint_keeps_alive_count_nothing():
    """A reentrant checkpoint under torch.compile leaves fake tensors alive whose data pointer raises:
    the walk over live tensors skips them instead of failing."""
    import torch._dynamo

    from zkit.activations.recompute import checkpoint

    lin = torch.nn.Linear(16, 16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    run = torch.compile(lambda t: checkpoint(lin, t, use_reentrant=True), backend="aot_eager")
    run(x).sum().backward()
    torch._dynamo.reset()
    import gc

    # the reset leaves the fake tensors to the collector: it must not take them between the two
    # readings (the first one walks over them, which is what this tests)
    gc.disable()
    try:
        before = live_tensor_bytes()
        extra = torch.zeros(100)
        assert live_tensor_bytes() - before == 400
        del extra
    finally:
        gc.enable()
        torch._dynamo.reset()


def test_live_tensor_bytes_counts_each_storage_once():
    import gc

    # garbage an earlier test left (a closed engine's cycles) must not be collected between the
    # two readings: it would count in the first and not in the second
    gc.collect()
    gc.disable()
    try:
        before = live_tensor_bytes()
        base = torch.zeros(1000)
        views = [base[:10], base.view(10, 100), base[500:]]
        param = torch.nn.Parameter(torch.zeros(250))
        param.grad = torch.ones(250)
        assert live_tensor_bytes() - before == 4000 + 1000 + 1000
    finally:
        gc.enable()
    del views, base, param
