"""Offload copies on a CUDA device: on a side stream, from pinned host memory, overlapping compute
(seen in a profiler trace), a bounded number in flight, and what they leave in device memory.
Skipped with a reason without CUDA; on CPU the same code paths are checked with deferred copies
(``plugins/zkit-offload/tests/test_async_copies.py``, ``tests/test_copies.py``)."""
from __future__ import annotations

import pytest
import torch

import zkit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

WIDTH, DEPTH = 2048, 8
OVERLAP_ROWS = 32768


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def _engine(zero: dict, dtype: str = "bf16"):
    cfg = {"train_micro_batch_size_per_gpu": 1024, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zkit.initialize(model=_model(), config=cfg)
    return engine


def _step(engine, rows: int = 1024) -> None:
    x = torch.randn(rows, WIDTH, device="cuda", dtype=engine.dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _kernels(prof) -> tuple[list, list]:
    """(copies, compute kernels) on the device in a trace, as (name, start, end) in microseconds."""
    copies, compute = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            (copies if "Memcpy" in e.name else compute).append((e.name, e.time_range.start, e.time_range.end))
    return copies, compute


def test_stage3_parameter_fetches_overlap_compute_on_a_side_stream():
    engine = _engine({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                      "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 3 * WIDTH * WIDTH})
    _step(engine)  # the first forward records the module order that prefetching follows
    # Enough rows that a layer's matmuls outlast the next unit's copy (8 MiB). At 1024 rows an
    # H200 finishes a layer in 15 us, a copy takes 150 us, and the host, about 300 us a module,
    # is what the device waits for: nothing is left to overlap. One step at that size first: the
    # caching allocator then holds its blocks, so no cudaMalloc (which waits for the device) runs
    # inside the profiled steps. Profiled once after a 1024-row step only, one run in four on an
    # H100 found no overlap.
    _step(engine, rows=OVERLAP_ROWS)
    torch.cuda.synchronize()
    assert all(su.shard.is_pinned() for su in engine.partitioner.sharded)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            _step(engine, rows=OVERLAP_ROWS)
        torch.cuda.synchronize()
    copies, compute = _kernels(prof)
    h2d = [c for c in copies if "HtoD" in c[0]]
    assert h2d, "no host-to-device copies in the trace"
    overlapping = [c for c in h2d if any(k[1] < c[2] and c[1] < k[2] for k in compute)]
    assert overlapping, f"none of {len(h2d)} host-to-device copies in two steps overlapped a compute kernel"
    assert len(engine.allocator.copies) <= engine.allocator.copies.max_in_flight
    engine.close()


def test_gradients_reach_the_pinned_host_master_through_the_side_stream():
    engine = _engine({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}})
    assert engine.allocator.copies.active
    assert all(m.is_pinned() for m in engine.partitioner.master)
    side = []
    copies = engine.allocator.copies
    original = copies.copy

    def spy(dst, src):
        out = original(dst, src)
        side.append(torch.cuda.current_stream() == torch.cuda.default_stream())  # the caller's stream is back
        return out

    copies.copy = spy  # an instance attribute in this test only, to watch the calls
    _step(engine)
    torch.cuda.synchronize()
    assert side and all(side)
    assert copies._side is not None and copies._side.stream_id != torch.cuda.current_stream().stream_id
    engine.close()


def test_cpu_offload_keeps_master_and_optimizer_state_off_the_device():
    numel = sum(p.numel() for p in _model().parameters())
    held = {}
    for name, zero in (("device", {"stage": 2}), ("offload", {"stage": 2, "offload_optimizer": {"device": "cpu"}})):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        engine = _engine(zero)
        _step(engine)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        engine.close()
        del engine
    # on the device without offload: bf16 parameters, fp32 master and two fp32 Adam moments
    # (12 bytes a parameter by the formula; 11 leaves room for the allocator's rounding)
    assert held["device"] - held["offload"] >= 11 * numel, held
