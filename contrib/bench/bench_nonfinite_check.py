"""What the non-finite check costs a step when nothing computes a gradient norm (bf16 or fp32, no
clipping, no fp16): the engine sums the gradients this rank steps, after reduction, and folds the
answer into the 4-byte all-reduce of the loss check.

One rank, so the check reads the whole gradient (at ZeRO 1-3 each of N ranks reads 1/N of it);
GPT preset, bf16, AdamW, ZeRO stage 0, one thread. Times, over ``--steps`` steps after one warm-up,
the check alone (``partitioner.grads_finite()`` between backward and step) and the whole step
(forward, backward, optimizer step, which runs the check once)::

    .venv/bin/python contrib/bench/bench_nonfinite_check.py --preset medium --steps 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import zkit
from zkit.models import GPT, GPTConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, seq_len=args.seq))
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 1_000_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq))
    checks, steps = [], []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        loss = engine(ids, ids)
        engine.backward(loss)
        t0 = time.perf_counter()
        assert bool(engine.partitioner.grads_finite())
        check = time.perf_counter() - t0
        engine.step()
        if i:
            checks.append(check)
            steps.append(time.perf_counter() - start - check)
    n = sum(p.numel() for p in model.parameters())
    c, s = statistics.median(checks), statistics.median(steps)
    print(f"GPT {args.preset}: {n / 1e6:.1f}M parameters, bf16, stage 0, 1 rank, 1 thread, seq {args.seq}")
    print(f"whole step {s * 1e3:.1f} ms, non-finite check {c * 1e3:.2f} ms ({c / s * 100:.2f}% of the step)")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
