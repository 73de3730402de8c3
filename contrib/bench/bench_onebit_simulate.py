"""1-bit Adam simulated in one process, in float64: N workers, exact algorithm, no packing and no
communication. Separates what freezing the variance costs from what the 1-bit compression costs,
on the byte MLP of ``bench_onebit_convergence.py`` with the same data order.

Variants: ``adam`` (averaged gradients); ``frozen`` (Adam with the variance frozen at the freeze
step, exact averaging, ``v = 0`` elements kept still); ``onebit`` (1-bit Adam as zkit runs it:
local momenta, compressed average of ``m / d`` with worker and server error feedback, elements
with ``v = 0`` at the freeze kept still); ``onebit-nomask`` (the same without keeping ``v = 0`` elements still).

    python contrib/bench/bench_onebit_simulate.py --steps 1000 --lr 2e-3
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_onebit_common import CORPUS  # noqa: E402
from bench_onebit_convergence import byte_mlp  # noqa: E402


def compress(rows: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """scale * sign per row over the live elements, scale = ||live part|| / sqrt(live count)."""
    rows = rows * live
    scale = torch.linalg.vector_norm(rows, dim=1, keepdim=True) / live.sum(dim=1, keepdim=True).clamp(min=1).sqrt()
    return torch.copysign(scale.expand_as(rows), rows) * live


def all_reduce(xs: list[torch.Tensor], worker: list[torch.Tensor], server: torch.Tensor, live: torch.Tensor):
    """Two-phase compressed average of flat ``xs`` (one per worker) as ``[N, chunk]`` rows."""
    n, w = xs[0].numel(), len(xs)
    chunk = -(-n // w)
    pad = lambda t: torch.cat([t, t.new_zeros(w * chunk - n)]).view(w, chunk)  # noqa: E731
    keep = pad(live.double())
    sent = []
    for r, x in enumerate(xs):
        b = pad(x) + worker[r]
        q = compress(b, keep)
        worker[r] = (b - q) * keep
        sent.append(q)
    b = torch.stack(sent).mean(dim=0) + server  # row s is what server s averages
    q = compress(b, keep)
    server.copy_((b - q) * keep)
    return q.reshape(-1)[:n]


def run(variant: str, lr: float, steps: int, freeze: int, world: int, micro_batch: int) -> list[float]:
    from zkit.data.text import ByteTextDataset

    b1, b2, eps = 0.9, 0.999, 1e-8
    torch.manual_seed(0)
    model = byte_mlp().double()
    params = list(model.parameters())
    train = ByteTextDataset(CORPUS, 16)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(1))
    n = sum(p.numel() for p in params)
    m, v = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    chunk = -(-n // world)
    worker = [torch.zeros(world, chunk, dtype=torch.float64) for _ in range(world)]
    server = torch.zeros(world, chunk, dtype=torch.float64)
    losses = []
    for step in range(steps):
        grads, loss = [], 0.0
        for r in range(world):
            start = (step * world + r) * micro_batch
            xs, ys = zip(*(train[int(i)] for i in order[start : start + micro_batch]))
            out = model(torch.stack(xs), torch.stack(ys))
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, params)]))
            loss += out.item() / world
        losses.append(loss)
        t = step + 1
        if variant == "adam" or t <= freeze:
            g = torch.stack(grads).mean(dim=0)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            update = m / (1 - b1**t) / ((v / (1 - b2**t)).sqrt() + eps)
            if t == freeze:
                d = (v / (1 - b2**t)).sqrt() + eps
                live = v != 0 if variant != "onebit-nomask" else torch.ones(n, dtype=torch.bool)
        elif variant == "frozen":
            m = torch.where(live, b1 * m + (1 - b1) * torch.stack(grads).mean(dim=0), 0.0)
            update = m / (1 - b1**t) / d
        else:
            y = all_reduce([torch.where(live, (b1 * m + (1 - b1) * g) / d, 0.0) for g in grads], worker, server, live)
            m = y * d
            update = y / (1 - b1**t)
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in params]) - lr * update
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if not math.isfinite(loss):
            losses += [float("nan")] * (steps - len(losses))
            break
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup-fraction", type=float, default=0.15)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--variants", default="adam,frozen,onebit,onebit-nomask")
    args = ap.parse_args()
    torch.set_num_threads(1)
    freeze = max(1, round(args.steps * args.warmup_fraction))
    tail = max(1, args.steps // 10)
    print(f"byte MLP, {args.world} simulated workers, float64, {args.steps} steps, lr {args.lr:g}, freeze at {freeze}")
    print("| variant | final train loss (mean of last 10%) | vs Adam | seconds |")
    print("|---|---|---|---|")
    final: dict[str, float] = {}
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        losses = run(variant, args.lr, args.steps, freeze, args.world, args.micro_batch)
        final[variant] = sum(losses[-tail:]) / tail
        vs = f"{100 * (final[variant] / final['adam'] - 1):+.2f}%" if "adam" in final else "-"
        print(f"| {variant} | {final[variant]:.4f} | {vs} | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
