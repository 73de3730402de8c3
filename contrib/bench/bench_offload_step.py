"""The engine's CPU-offloaded step: one fused pass against torch's kernel in the same engine.

Both variants are the same engine, config and model (bf16 GPT, ZeRO stage 2 or 3, optimizer state
and master offloaded to the host); they differ only in the offload optimizer's ``backend``:

* ``numba`` (what the default ``auto`` does here): the partitioner hands zkit-offload's Numba
  kernel the gradient factor and the bf16 parameters as copy-out twins, so unscale x clip, the AdamW update and the bf16 copy of
  the new weights are one pass (``zkit.optim.fused_step``);
* ``torch``: the partitioner scales the gradients, torch's fused AdamW kernel steps, and the master
  is copied into the parameters, three passes.

2 gloo ranks x 1 thread; rounds alternate the variants; every variant runs 1 warm-up and
``--steps`` timed steps. The table gives medians of the slowest rank: the whole step (forward,
backward, reduction, optimizer step) and the optimizer-step phase alone (``wall_clock_breakdown``)::

    .venv/bin/python contrib/bench/bench_offload_step.py --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

VARIANTS = ("numba", "torch")


def rank_round(stage: int, layers: int, d_model: int, seq: int, steps: int) -> dict[str, dict[str, list[float]]]:
    import gc
    import time

    import torch
    import torch.distributed as dist

    import zkit
    from zkit import telemetry
    from zkit.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=8192, seq_len=seq, n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model)
    batch = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    out: dict[str, dict[str, list[float]]] = {}
    for backend in VARIANTS:
        torch.manual_seed(0)
        model = GPT(cfg)
        zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 5_000_000, "overlap_comm": True,
                                "offload_optimizer": {"device": "cpu"}}
        if stage == 3:
            zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=10_000)
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                  "wall_clock_breakdown": True, "steps_per_print": 1_000_000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "backend": backend}},
                  "zero_optimization": zero}
        engine, *_ = zkit.initialize(model=model, config=config)
        whole, phase = [], []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            loss = engine(batch, batch)
            engine.backward(loss)
            engine.step()
            took = time.perf_counter() - start
            breakdown = telemetry.of(engine).wall_clock.totals.get("step", 0.0)
            telemetry.of(engine).wall_clock.take()
            if i:
                whole.append(took)
                phase.append(breakdown)
        out[backend] = {"whole": whole, "phase": phase, "kernel": [engine.partitioner.step_kernel()],
                        "params": [sum(p.numel() for p in model.parameters())]}
        engine.close()
        del engine, model
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=704)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--stages", default="2,3")
    args = p.parse_args(argv)
    from zkit.testing import run_ranks

    print(f"{'stage':>5} {'variant':>8} {'params':>8} | {'whole step s':>12} {'optimizer step s':>16} | kernel")
    for stage in (int(s) for s in args.stages.split(",")):
        whole: dict[str, list[float]] = {v: [] for v in VARIANTS}
        phase: dict[str, list[float]] = {v: [] for v in VARIANTS}
        kernel, params = {}, 0
        for _ in range(args.rounds):
            per_rank = run_ranks(rank_round, 2, args=(stage, args.layers, args.d_model, args.seq, args.steps),
                                 timeout=3600, threads_per_rank=1)
            for v in VARIANTS:
                whole[v] += [max(ts) for ts in zip(*(r[v]["whole"] for r in per_rank))]
                phase[v] += [max(ts) for ts in zip(*(r[v]["phase"] for r in per_rank))]
                kernel[v] = per_rank[0][v]["kernel"][0]
                params = per_rank[0][v]["params"][0]
        for v in VARIANTS:
            print(f"{stage:>5} {v:>8} {params / 1e6:>7.1f}M | {statistics.median(whole[v]):>12.3f} "
                  f"{statistics.median(phase[v]):>16.3f} | {kernel[v]}")
        print(f"{stage:>5} {'torch/numba':>8} {'':>8} | {statistics.median(whole['torch']) / statistics.median(whole['numba']):>11.2f}x "
              f"{statistics.median(phase['torch']) / statistics.median(phase['numba']):>15.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
