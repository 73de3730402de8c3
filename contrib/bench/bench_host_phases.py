"""Where a step's host time goes: forward, backward and optimizer step of plain PyTorch and zkit's
stages, side by side in one process, their steps interleaved (one step of each in turn), so that
the load of a shared machine falls on every contestant alike.

``bench_host.py`` times each contestant in a process of its own, one after the other: on a
machine whose load changes from minute to minute its host-time ratios move by 10-30 % from run to
run. Here every contestant is built in one gloo process of world size 1 (one thread) on
``bench_gpu_model.PlainGPT`` (by default 24 layers, width 64, micro-batch 2, as ``bench_host.py``)
and, after ``--warmup`` steps, ``--steps`` rounds run one step of each contestant in turn; per
phase, the median ``time.thread_time()`` (the calling thread's CPU time), and the whole step's
median and ratio to plain PyTorch's::

    python contrib/bench/bench_host_phases.py --dtype fp32
    python contrib/bench/bench_host_phases.py --smoke      # 2 layers, 2 rounds: the paths
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CONTESTANTS = ("torch", "zkit-0", "zkit-1", "zkit-2", "zkit-3")
#: one step in phases: each callable runs its phase and hands what the next needs on
Phases = tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"from {', '.join(CONTESTANTS)}")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="rounds of one step per contestant")
    p.add_argument("--smoke", action="store_true", help="2 layers, 2 rounds: a check of the paths, no figures")
    args = p.parse_args(argv)
    args.names = [n for n in args.contestants.split(",") if n]
    unknown = sorted(set(args.names) - set(CONTESTANTS))
    if unknown:
        p.error(f"unknown contestants {', '.join(unknown)}; choose from {', '.join(CONTESTANTS)}")
    if args.smoke:
        args.layers, args.warmup, args.steps = 2, 1, 2
    return args


def torch_phases(shape: Any, dtype: str) -> Phases:
    """Plain PyTorch as ``bench_host.py`` runs it: autocast in bf16, ``AdamW(fused=True)``."""
    import torch

    from bench_gpu_contestants import _autocast
    from bench_gpu_model import PlainGPT
    from zero_workloads import ADAMW

    torch.manual_seed(0)
    model = PlainGPT(shape)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

    def forward(ids):
        with _autocast(dtype, torch.device("cpu")):
            return model(ids, ids)

    def step(_):
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, lambda loss: loss.backward(), step


def zkit_phases(name: str, shape: Any, micro_batch: int, dtype: str) -> tuple[Phases, Callable[[], None]]:
    """zkit contestant ``name`` as ``bench_host.py`` builds it, and its ``close``."""
    import torch

    import zkit
    from bench_gpu_contestants import zkit_config
    from bench_gpu_model import PlainGPT

    torch.manual_seed(0)
    cfg = zkit_config(name, micro_batch, dtype, None)
    with zkit.zero.Init(config=cfg, enabled=cfg["zero_optimization"]["stage"] == 3):
        model = PlainGPT(shape)
    engine, *_ = zkit.initialize(model=model, config=cfg)
    return (lambda ids: engine(ids, ids), engine.backward, lambda _: engine.step()), engine.close


def run(args: argparse.Namespace) -> dict[str, list[tuple[float, float, float]]]:
    """Per contestant, each timed round's (forward, backward, step) thread seconds."""
    import torch
    import torch.distributed as dist

    from bench_gpu_model import Shape
    from bench_host import SHAPE, batches_for

    torch.set_num_threads(1)
    shape = Shape(**dict(SHAPE, layers=args.layers))
    ids = batches_for(shape, args.micro_batch, 1, 0)[0]
    phases, closes = {}, []
    for name in args.names:
        if name == "torch":
            phases[name] = torch_phases(shape, args.dtype)
        else:
            phases[name], close = zkit_phases(name, shape, args.micro_batch, args.dtype)
            closes.append(close)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in args.names}
    try:
        for round_ in range(args.warmup + args.steps):
            for name, (forward, backward, step) in phases.items():
                t0 = time.thread_time()
                loss = forward(ids)
                t1 = time.thread_time()
                backward(loss)
                t2 = time.thread_time()
                step(loss)
                t3 = time.thread_time()
                if round_ >= args.warmup:
                    times[name].append((t1 - t0, t2 - t1, t3 - t2))
    finally:
        for close in closes:
            close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return times


def table(times: dict[str, list[tuple[float, float, float]]], args: argparse.Namespace) -> str:
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    base = ms([sum(t) for t in times["torch"]]) if "torch" in times else None
    lines = [f"{args.dtype}, {args.layers} layers, micro-batch {args.micro_batch}, world size 1, "
             f"median of {args.steps} interleaved steps (thread time, ms)\n",
             "| contestant | forward | backward | optimizer step | step | x plain |", "|---|---|---|---|---|---|"]
    for name, rounds in times.items():
        fwd, bwd, opt = (ms(list(col)) for col in zip(*rounds))
        total = ms([sum(t) for t in rounds])
        ratio = f"{total / base:.2f}" if base else ""
        lines.append(f"| {'plain PyTorch' if name == 'torch' else name} | {fwd:.1f} | {bwd:.1f} | {opt:.1f} | "
                     f"{total:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [HERE, REPO]
    args = parse(argv)
    import torch.distributed as dist

    from zkit.testing import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(table(run(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
