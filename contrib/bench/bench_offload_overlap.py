"""ZeRO-Offload with the host step overlapped against the same step in sequence, on the CPU: one
rank, two threads (backward on the calling thread, ``torch.set_num_threads(1)``; the host
optimizer on the store's own thread, Numba at one thread).

Two engines train the same GPT (``zkit.models.gpt``) at ZeRO stage 2 with
``offload_optimizer: cpu`` and AdamW: **in sequence** (the host step after backward) and
**overlapped** (``offload_optimizer.step_in_backward``: each unit's host step during backward, as
soon as its gradients have arrived). Steps alternate between the two engines, one each per round
after ``--warmup`` rounds, so a change in the machine's load falls on both alike. Each step is timed
on the wall clock (forward, backward and ``step()``: the overlap moves work to another thread, so
the calling thread's CPU time would not see it); the table gives each one's median, the ratio
overlapped / in sequence, and whether the two runs' parameters are still bit-equal::

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python contrib/bench/bench_offload_overlap.py
    python contrib/bench/bench_offload_overlap.py --smoke      # tiny: the paths, no figures
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="2 layers of width 64, 3 rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.vocab, args.seq, args.warmup, args.rounds = 2, 64, 512, 16, 1, 3
    return args


def config(dtype: str, overlapped: bool, micro_batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 2_000_000, "overlap_comm": True,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": False,
                                                        "step_in_backward": overlapped}},
            "steps_per_print": 10_000, **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}


def run(args: argparse.Namespace) -> dict:
    """On the one rank: build both engines, alternate their steps, time each."""
    import numba
    import torch

    import zkit
    from zkit.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=max(1, args.width // 64),
                    d_model=args.width)
    engines = {}
    for name, overlapped in (("in sequence", False), ("overlapped", True)):
        torch.manual_seed(0)
        engines[name], *_ = zkit.initialize(model=GPT(cfg), config=config(args.dtype, overlapped, args.micro_batch))
    params = sum(p.numel() for p in engines["in sequence"].module.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len), generator=g)
               for _ in range(args.warmup + args.rounds)]
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i, ids in enumerate(batches):
        for name, engine in engines.items():
            t = time.perf_counter()
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    equal = all(torch.equal(a, b) for a, b in zip(engines["in sequence"].module.parameters(),
                                                  engines["overlapped"].module.parameters()))
    for engine in engines.values():
        engine.close()
    return {"times": times, "params": params, "bit_equal": equal}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    sys.path.insert(0, HERE)
    import bench_offload_overlap  # the ranks import the rank function from this module by name
    from zkit.testing import run_ranks

    (r,) = run_ranks(bench_offload_overlap.run, 1, args=(args,), timeout=1800, start="forkserver", env={"PYTHONWARNINGS": "ignore"})
    seq, ovl = (1e3 * statistics.median(r["times"][n]) for n in ("in sequence", "overlapped"))
    print(f"\nGPT {args.layers} x {args.width}, {r['params'] / 1e6:.1f}M parameters, {args.dtype}, "
          f"{args.micro_batch} x {args.seq} tokens; one rank, backward on 1 thread + the host step's thread; "
          f"median of {args.rounds} interleaved steps each\n")
    print("| step | median ms | min ms | max ms |")
    print("|---|---|---|---|")
    for name in ("in sequence", "overlapped"):
        t = [1e3 * x for x in r["times"][name]]
        print(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |")
    print(f"\noverlapped / in sequence: {ovl / seq:.3f}; parameters bit-equal after the run: {r['bit_equal']}")


if __name__ == "__main__":
    main()
