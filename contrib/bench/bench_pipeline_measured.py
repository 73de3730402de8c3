"""Pipeline bubble and activation memory measured on real ranks (gloo, one process per stage).

Bubble: every stage's interpreter times its forward and backward instructions
(``zkit_pipeline.probe.StageProbe``); the bubble is the stages' idle time (batch wall time minus
compute) over their compute time, against (p-1)/m for GPipe and 1F1B and (p-1)/(v*m) for
interleaved 1F1B, and the simulator's figure for ZB-H1.

This machine has 2 cores: at p = 4 four processes compete for them, so layers that compute would
take longer the more stages happen to run at once, which is not what a pipeline on its own
accelerators sees. The bubble runs therefore use :class:`SleepLayer`: one layer per stage (per
chunk when interleaved) whose forward sleeps ``F``, whose input-gradient backward sleeps ``Bx`` and
whose weight-gradient backward sleeps ``Bw`` (``F = Bx = Bw``, so ``B = 2F`` as in the simulator),
with a tiny real matmul so autograd, sends and receives are real. Sleeping does not occupy a
core, so these durations do not depend on contention; what remains measured is the schedule's
order, the transfers and the interpreter's overhead. The first stage has no input gradient to
compute, so its layer puts ``Bx`` into the weight half (its backward still costs ``B``).

Memory: layers that compute (Linear + Tanh), and the peak bytes of activations autograd holds on
each stage during one batch (saved-tensor hooks), in units of one micro-batch's activations of a
stage: GPipe's grows with m, 1F1B's stays at p - s.

    python contrib/bench/bench_pipeline_measured.py [--unit-ms 40] [--batches 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))
MICRO_COUNTS = (4, 8, 16)
WIDTH, BATCH = 8, 4


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the cost of one half of a layer's backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepLayer(nn.Module):
    """``y = x W`` whose forward, input-gradient and weight-gradient passes each take a fixed time."""

    def __init__(self, f: float, bx: float, bw: float) -> None:
        super().__init__()
        self.f, self.bx, self.bw = f, bx, bw
        self.weight = nn.Parameter(torch.eye(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.f)
        wd, xd = self.weight.detach(), x.detach()
        if x.requires_grad:  # the input path (x W_detached) and the weight path (x_detached W) apart
            xi, wi = _SleepInBackward.apply(x, self.bx), _SleepInBackward.apply(self.weight, self.bw)
        else:  # first stage: no input gradient, the whole backward in the weight half
            xi, wi = x, _SleepInBackward.apply(self.weight, self.bx + self.bw)
        return xi @ wd + xd @ (wi - wd)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _run(schedule: str, v: int, m: int, layers: list, batches: int, warmup: int = 1,
         width: int = WIDTH, batch: int = BATCH) -> dict:
    import torch.distributed as dist

    from zkit_pipeline import PipelineModule
    from zkit_pipeline.interpreter import PipelineRunner
    from zkit_pipeline.probe import StageProbe
    from zkit_pipeline.schedules import BUILTIN_SCHEDULES

    p = dist.get_world_size()
    module = PipelineModule(layers, p, _mse, partition_method="uniform", virtual_stages=v, schedule=schedule)
    probe = StageProbe()
    runner = PipelineRunner(module, BUILTIN_SCHEDULES[schedule], m, probe=probe)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)) for _ in range(m)]
    for i in range(warmup + batches):
        if i == warmup:
            probe.reset()
        dist.barrier()
        runner.train_batch(iter(data))
        module.zero_grad(set_to_none=True)
    return probe.report()


def bubble_rank(unit: float, batches: int, rounds: int) -> list[dict]:
    """Every (schedule, m) at this world size, ``rounds`` times interleaved; the probe's report
    per run."""
    import torch.distributed as dist

    p = dist.get_world_size()
    out = []
    for r in range(rounds):
        for m in MICRO_COUNTS:
            for name, v in SCHEDULES:
                layers = [SleepLayer(unit / v, unit / v, unit / v) for _ in range(p * v)]
                rep = _run(name, v, m, layers, batches)
                out.append({"round": r, "schedule": name, "v": v, "m": m, **rep})
    return out


def _bubble(stages: list[dict]) -> tuple[float, list[float], float]:
    """(bubble, idle fraction per stage, makespan per batch) of one run over all its stages."""
    # every stage is idle until the last one finishes: the makespan of each batch spans the
    # first stage's start to the last stage's end
    n = len(stages[0]["spans"])
    makespan = sum(max(s["spans"][b][1] for s in stages) - min(s["spans"][b][0] for s in stages) for b in range(n))
    idle = [makespan - s["busy_s"] for s in stages]
    return sum(idle) / sum(s["busy_s"] for s in stages), [x / makespan for x in idle], makespan / n


def memory_rank(width: int, batch: int) -> list[dict]:
    """Peak saved activations of GPipe and 1F1B per m, and of one micro-batch alone (m = 1)."""
    import torch.distributed as dist

    p = dist.get_world_size()

    def peak(name: str, m: int) -> int:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2 * p)]
        return _run(name, 1, m, layers, batches=1, warmup=0, width=width, batch=batch)["peak_saved_bytes"]

    one = peak("1f1b", 1)
    return [{"schedule": name, "m": m, "peak_saved_bytes": peak(name, m), "per_micro": one}
            for m in MICRO_COUNTS for name in ("gpipe", "1f1b")]


def _simulated_zb(p: int, m: int) -> float:
    from zkit_pipeline.schedules import BUILTIN_SCHEDULES
    from zkit_pipeline.simulate import simulate

    return simulate([list(BUILTIN_SCHEDULES["zb_h1"](p, s, m)) for s in range(p)], m).bubble_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unit-ms", type=float, default=40.0, help="forward time of a stage (backward: twice)")
    parser.add_argument("--batches", type=int, default=2, help="timed global batches per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is shown")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    from zkit.testing import run_ranks

    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; unit {args.unit_ms} ms, "
          f"median of {args.rounds} rounds of {args.batches} batches")
    print(f"{'schedule':18} {'p':>2} {'m':>3} {'v':>2} {'bubble':>8} {'theory':>8} {'ratio':>6}  "
          f"{'idle fraction per stage':28} {'batch s':>8}")
    for p in (2, 4):
        results = run_ranks(bubble_rank, p, args=(args.unit_ms / 1000, args.batches, args.rounds), timeout=1800)
        runs: dict[tuple, list] = {}
        for i, row in enumerate(results[0]):
            runs.setdefault((row["schedule"], row["v"], row["m"]), []).append(_bubble([r[i] for r in results]))
        for (name, v, m), measured in runs.items():
            bubble, fractions, wall = sorted(measured)[len(measured) // 2]  # the median round
            theory = _simulated_zb(p, m) if name == "zb_h1" else (p - 1) / (v * m)
            cells = " ".join(f"{f:.3f}" for f in fractions)
            print(f"{name:18} {p:>2} {m:>3} {v:>2} {bubble:8.4f} {theory:8.4f} {bubble / theory:6.2f}  "
                  f"{cells:28} {wall:8.3f}")
    print("(theory: (p-1)/m, (p-1)/(v m); zb_h1: the simulator's bubble with F = Bx = Bw)")
    print(f"# load average after bubble runs: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.skip_memory:
        return
    print()
    print(f"{'schedule':8} {'p':>2} {'m':>3}  peak saved activations per stage (micro-batches' worth)")
    for p in (2, 4):
        results = run_ranks(memory_rank, p, args=(256, 32), timeout=600)
        for i, row in enumerate(results[0]):
            per_stage = " ".join(f"{r[i]['peak_saved_bytes'] / r[i]['per_micro']:5.2f}" for r in results)
            print(f"{row['schedule']:8} {p:>2} {row['m']:>3}  {per_stage}")
    print("(1F1B: stage s holds at most p - s micro-batches; GPipe: m)")


if __name__ == "__main__":
    main()
