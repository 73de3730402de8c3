"""Where a step's time goes, per rank: forward, backward and optimizer step, and inside them the
time zkit's collectives take to issue and the time the rank waits for them (``--phases``).

zkit's engine runs with :class:`TimedCommunicator`, torch's communicator with a clock on every
flat collective: the seconds spent issuing it and the seconds a rank blocks in its handle's
``wait()``, by the phase the bench is in (forward / backward / step) and by kind (``gather``: the
parameter all-gathers; ``reduce``: gradient reduce-scatters and all-reduces). Time a rank does not
block is overlapped with compute (or, on a CPU, competes with it for the cores). The torch
contestants get forward / backward / step only: DDP's all-reduce runs inside autograd's backward.
"""
from __future__ import annotations

import gc
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from zero_workloads import Workload, batches

PHASES = ("forward", "backward", "step")
KINDS = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "reduce"}
COLUMNS = ("forward", "backward", "step", "total", "gather issue", "gather wait", "reduce issue", "reduce wait")
#: minor page faults per step: memory mapped afresh and touched (glibc returns large freed blocks)
FAULTS = "page faults"


class _Clock:
    """The seconds booked to each column in the current step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, column: str, seconds: float) -> None:
        self.seconds[column] = self.seconds.get(column, 0.0) + seconds


class _TimedHandle:
    def __init__(self, inner: Any, clock: _Clock, column: str) -> None:
        self.inner, self.clock, self.column = inner, clock, column

    def wait(self) -> None:
        start = time.perf_counter()
        self.inner.wait()
        self.clock.add(self.column, time.perf_counter() - start)


def timed_communicator_record(clock: _Clock) -> Any:
    """A communicator record (not installed: handed to the engine through ``zkit.Stack``) whose
    communicator books issue and wait times on ``clock``."""
    from zkit.torch_distributed.communicator import TorchCommunicator
    from zkit.core.records import CommunicatorRecord

    class TimedCommunicator(TorchCommunicator):
        def _timed(self, kind: str, call: Any, async_op: bool) -> Any:
            column = KINDS[kind]
            start = time.perf_counter()
            handle = call()  # a blocking collective's whole time is waiting
            clock.add(f"{column} issue" if async_op else f"{column} wait", time.perf_counter() - start)
            return _TimedHandle(handle, clock, f"{column} wait") if async_op and handle is not None else handle

        def all_gather(self, output, input, async_op=False):
            return self._timed("all_gather", lambda: super(TimedCommunicator, self).all_gather(output, input, async_op), async_op)

        def reduce_scatter(self, output, input, op="sum", async_op=False, key=None):
            return self._timed("reduce_scatter", lambda: super(TimedCommunicator, self).reduce_scatter(
                output, input, op, async_op, key), async_op)

        def all_reduce(self, tensor, op="sum", async_op=False, key=None):
            return self._timed("all_reduce", lambda: super(TimedCommunicator, self).all_reduce(tensor, op, async_op, key), async_op)

    return CommunicatorRecord(name="timed-torch", factory=lambda group, config: TimedCommunicator(group, config),
                              description="torch.distributed with a clock on every collective (benchmark)")


def _zkit_parts(w: Workload, name: str, clock: _Clock) -> tuple[Any, Any, Any, Any]:
    import zkit
    from zero_torch_side import build_zkit

    engine = build_zkit(w, name, zkit.Stack(communicator=timed_communicator_record(clock)))
    return (lambda b: engine(b, b)), engine.backward, engine.step, engine.close


def _torch_parts(w: Workload, name: str) -> tuple[Any, Any, Any, Any]:
    from zero_torch_side import build_torch_parts, torch_forward

    model, opt = build_torch_parts(w, name)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return (lambda b: torch_forward(w, model, b)), (lambda loss: loss.backward()), step, (lambda: None)


def phase_ranks(w: Workload, names: list[str]) -> dict[str, dict[str, list[float]]]:
    """On each rank: per contestant, per column of :data:`COLUMNS`, the seconds of each timed step."""
    torch.set_num_threads(1)
    out: dict[str, dict[str, list[float]]] = {}
    for name in names:
        clock = _Clock()
        forward, backward, step, close = (
            _zkit_parts(w, name, clock) if name.startswith("zkit ZeRO-") else _torch_parts(w, name)
        )
        per_step: dict[str, list[float]] = {c: [] for c in (*COLUMNS, FAULTS)}
        for i, batch in enumerate(batches(w, dist.get_rank(), w.warmup_steps + w.timed_steps)):
            dist.barrier()
            clock.seconds = {}
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            loss = forward(batch)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            if i >= w.warmup_steps:
                spent = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0, **clock.seconds}
                for c in COLUMNS:
                    per_step[c].append(spent.get(c, 0.0))
                per_step[FAULTS].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        close()
        out[name] = per_step
        del forward, backward, step, close
        gc.collect()
        dist.barrier()
    return out


def phase_table(per_rank: list[dict[str, dict[str, list[float]]]], names: list[str]) -> str:
    """One row per contestant and rank: the median of each column over the timed steps (ms; page
    faults: thousands)."""
    rows = [["contestant", "rank", *[f"{c} ms" for c in COLUMNS], f"{FAULTS} k"]]
    for name in names:
        for rank, result in enumerate(per_rank):
            cols = result[name]
            torch_side = not name.startswith("zkit ZeRO-")
            rows.append([name, str(rank), *[
                "" if torch_side and " " in c else f"{statistics.median(cols[c]) * 1000:.0f}" for c in COLUMNS
            ], f"{statistics.median(cols[FAULTS]) / 1000:.1f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    return "\n".join(lines)
