"""What a training step costs the host (:mod:`zkit.step_counts`, ``contrib/bench/bench_host.py``):
the ops one steady-state step dispatches (about one kernel launch each on a GPU) and the
host-device syncs among them. Counts are deterministic, so they are pinned here: a change that
adds ops or a sync to the step fails a test naming the contestant."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import zkit
from zkit.step_counts import count_step, storages_of
from zkit.testing import run_ranks

from tests.host_cost_ranks import BENCH, count_contestants

ZKIT = ["zkit-0", "zkit-1", "zkit-2", "zkit-3", "zkit-2-offload", "zkit-3-offload"]
#: ops of one step of bench_host.py's model at 2 layers, world size 1, rank 0 (plain PyTorch, then
#: zkit's stages 0-2 and both offloads; stage 3's are pinned with its gathers)
PINNED_OPS = {
    "bf16": {"torch": 284, "zkit-0": 247, "zkit-1": 247, "zkit-2": 247, "zkit-2-offload": 243, "zkit-3-offload": 251},
    "fp32": {"torch": 235, "zkit-0": 242, "zkit-1": 242, "zkit-2": 242, "zkit-2-offload": 240, "zkit-3-offload": 242},
}


def test_the_counter_tells_ops_syncs_host_reads_and_their_tensors_apart():
    device_side, host_side = torch.ones(3), torch.zeros(2)
    counts, total = count_step(lambda: float(device_side.sum()) + float(host_side[0]) + float(host_side[1]),
                               host_resident=storages_of(lambda: [host_side]))
    assert total == 3.0
    assert counts.syncs == 1 and counts.syncs_by_op == {"aten::_local_scalar_dense": 1}
    assert counts.host_reads == 2  # views of host_side share its memory
    assert counts.collectives == 0 and counts.ops == sum(counts.by_op.values())


def test_a_tensor_autograd_saves_or_unpacks_is_no_op_but_a_detach_called_is_one():
    """Under saved-tensor hooks (stage 3's, while units are released between forward and backward)
    autograd copies each saved tensor's TensorImpl, and with a dispatch mode active that copy
    reaches the mode as a detach: torch's profiler sees no such op, so the counter counts none."""
    x = torch.randn(4, requires_grad=True)

    def step(hooks: bool) -> None:
        x.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else contextlib.nullcontext():
            y = (x * 2).sin().cos().sum()
        y.backward()

    plain, _ = count_step(lambda: step(False))
    hooked, _ = count_step(lambda: step(True))
    assert hooked.by_op == plain.by_op
    called, _ = count_step(lambda: x.detach())
    assert called.by_op == {"aten::detach": 1}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_zkit_steps_wait_for_nothing_and_dispatch_the_pinned_ops(dtype):
    (counts,) = run_ranks(count_contestants, 1, args=(["torch", *ZKIT], dtype, 2), timeout=600)
    assert {name: c["syncs"] for name, c in counts.items()} == {name: 0 for name in counts}
    # offload: the host optimizer reads the step's verdict once, in host memory, after the wait
    # for its gradients; its own state (the step counts) through numpy, not tensors
    assert {name: c["host_reads"] for name, c in counts.items()} == {
        name: int(name.endswith("-offload")) for name in counts}
    assert {name: counts[name]["ops"] for name in PINNED_OPS[dtype]} == PINNED_OPS[dtype]


#: the same at world size 2, rank 0, bf16: stages 2-3 pack each unit's gradients into its bucket
#: with one _foreach_copy_ through views made once; stage 3 with parameters on the host gathers per
#: block as stage 3 does (per module it took 530 ops and 65 collectives)
PINNED_OPS_TWO_RANKS = {"zkit-0": 250, "zkit-1": 263, "zkit-2": 264, "zkit-3": 305, "zkit-2-offload": 260,
                        "zkit-3-offload": 302}


def test_two_ranks_wait_for_nothing_and_reduce_once_per_unit():
    results = run_ranks(count_contestants, 2, args=(ZKIT, "bf16", 2), timeout=600)
    for counts in results:
        assert {name: c["syncs"] for name, c in counts.items()} == {name: 0 for name in counts}
        # the non-finite verdict's all-reduce beside the gradients' reductions (one per unit)
        assert counts["zkit-0"]["collectives"] == 2 and counts["zkit-2"]["collectives"] == 5
        # stage 3, parameters on the host or not: one gather per unit, a unit per block (2) and the
        # root, after the step (every parameter of this model within the persistence threshold),
        # and one reduction per unit
        assert counts["zkit-3"]["collectives"] == counts["zkit-3-offload"]["collectives"] == 13
    assert {name: c["ops"] for name, c in results[0].items()} == PINNED_OPS_TWO_RANKS


def _engine(**extra):
    sys.path.insert(0, BENCH)
    from bench_gpu_model import PlainGPT, Shape

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 1000, **extra}
    engine, *_ = zkit.initialize(model=PlainGPT(Shape(layers=2, width=32, heads=2, vocab=64, seq=16)), config=cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        engine.backward(engine(ids, ids))
        engine.step()

    return engine, step


@pytest.mark.parametrize("extra,syncs", [
    ({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}, 0),
    ({"gradient_clipping": 1.0, "bf16": {"enabled": True}}, 0),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, 1),
], ids=["clipping-stage-2", "clipping-bf16", "fp16-dynamic-scale"])
def test_clipping_stays_on_the_device_and_fp16_reads_its_verdict_once(extra, syncs):
    engine, step = _engine(**extra)
    for _ in range(3):
        step()
    counts, _ = count_step(step)
    assert counts.syncs == syncs, counts.syncs_by_op
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0 and engine.skipped_steps == 0
    engine.close()


def test_bench_host_smoke_run_prints_its_table(tmp_path):
    sys.path.insert(0, BENCH)
    import bench_host

    assert bench_host.main(["--smoke", "--contestants", "torch,zkit-2", "--worlds", "1", "--dtypes", "bf16",
                            "--out", str(tmp_path)]) == 0
    table = (tmp_path / "bench_host.md").read_text()
    assert "| zkit stage 2 |" in table and "bf16, world size 1" in table
    assert os.path.exists(tmp_path / "bench_host.json")


def test_bench_host_phases_smoke_run_prints_its_table():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_host_phases.py"), "--smoke", "--contestants",
                          "torch,zkit-2"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| plain PyTorch |" in out.stdout and "| zkit-2 |" in out.stdout and "| 1.00 |" in out.stdout


@pytest.mark.parametrize("stage", [0, 1])
def test_gradient_buffers_are_made_once_and_hold_no_memory_between_steps(stage):
    engine, step = _engine(zero_optimization={"stage": stage})
    step()
    bufs, views = list(engine.partitioner.grad_bufs), [p.grad for p in engine.module.parameters()]
    assert all(b.untyped_storage().nbytes() == 0 for b in bufs) and all(v is None for v in views)
    engine.backward(engine(*[torch.zeros(2, 16, dtype=torch.long)] * 2))
    assert all(a is b for a, b in zip(engine.partitioner.grad_bufs, bufs))
    assert all(b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in bufs)
    engine.step()
    engine.close()


def test_gradient_buffers_inside_an_allocators_larger_block_are_made_per_step(tmp_path):
    # The nvme allocator's host buffers are aligned slices of larger allocations: resizing their
    # storage would cut the buffer (a heap corruption); they are handed back and made again.
    def train(**zero):
        engine, step = _engine(zero_optimization={"stage": 1, **zero})
        for _ in range(3):
            step()
        out = [p.detach().clone() for p in engine.module.parameters()]
        engine.close()
        return out

    nvme = train(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    assert all(torch.equal(a, b) for a, b in zip(train(), nvme))
