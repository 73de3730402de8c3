"""Overhead: step time of ZeRO stages 2 and 3 with CPU offload against the same stage without,
zkit and DeepSpeed side by side in one run (2 gloo ranks, 1 thread each, fp32, Adam, a GPT that
fits both ways).

Without offload each side uses its own optimizer for the config's ``Adam`` (zkit: torch's fused
Adam; DeepSpeed: what it picks on its CPU accelerator); with ``offload_optimizer`` (and, at stage 3,
``offload_param``) on ``cpu`` each uses its CPU Adam (zkit's Numba kernel, DeepSpeedCPUAdam). Rounds
alternate between the two sides; every round builds each variant, runs 1 warm-up and
``--steps`` timed steps (slowest rank per step); the table gives the median over all rounds and the
ratio offload / no offload per side::

    python contrib/bench/bench_offload_overhead.py --rounds 3 --ds-python /tmp/dsvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "OFFLOAD_OVERHEAD_RESULT "
#: (stage, offload device) per variant
VARIANTS = ((2, "none"), (2, "cpu"), (3, "none"), (3, "cpu"))


def config(stage: int, offload: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000,
                            "overlap_comm": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=5_000_000, stage3_param_persistence_threshold=10_000)
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": False}
        if stage == 3:
            zero["offload_param"] = {"device": offload, "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": zero,
            "steps_per_print": 10_000}


def rank_round(side: str, layers: int, d_model: int, steps: int) -> dict[str, list[float]]:
    """On each rank: build every variant, time its steps (after a barrier each)."""
    import gc

    import torch
    import torch.distributed as dist

    from zkit.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=8192, seq_len=128, n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model)
    batch = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(dist.get_rank()))
    out: dict[str, list[float]] = {}
    for stage, offload in VARIANTS:
        torch.manual_seed(0)
        model = GPT(cfg)
        if side == "zkit":
            import zkit

            engine, *_ = zkit.initialize(model=model, config=config(stage, offload))
        else:
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=config(stage, offload), dist_init_required=False)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(batch, batch)
            engine.backward(loss)
            engine.step()
            if i:
                times.append(time.perf_counter() - t0)
        out[f"{stage}-{offload}"] = times
        (engine.close if side == "zkit" else engine.destroy)()
        del engine, model
        gc.collect()
    return out


def run_side(side: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """One round of one side in a fresh interpreter (DeepSpeed's own for ``ds``); per variant the
    slowest rank's time of each step."""
    python = args.ds_python if side == "ds" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--child", side, "--layers", str(args.layers),
           "--d-model", str(args.d_model), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONNOUSERSITE="1", PYTHONWARNINGS="ignore")
    if side == "ds":
        from zero_deepspeed_side import deepspeed_command

        _, ds_env = deepspeed_command(python, [], args.shim_dir)
        env.update(DS_ACCELERATOR="cpu", PYTHONPATH=ds_env["PYTHONPATH"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            per_rank = json.loads(line[len(RESULT):])
            return {k: [max(ts) for ts in zip(*(r[k] for r in per_rank))] for k in per_rank[0]}
    raise RuntimeError(f"{side} round failed:\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python", help="DeepSpeed's interpreter ('' to skip)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    if args.child:
        from zkit.testing import run_ranks

        results = run_ranks(rank_round, 2, args=(args.child, args.layers, args.d_model, args.steps),
                            timeout=args.timeout)
        print(RESULT + json.dumps(results), flush=True)
        return 0
    args.shim_dir = tempfile.mkdtemp(prefix="zkit-ds-shim-")
    sides = ["zkit"] + (["ds"] if args.ds_python else [])
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    loads = []
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):  # alternate which side goes first
            loads.append(os.getloadavg()[0])
            for k, ts in run_side(side, args).items():
                samples[side].setdefault(k, []).extend(ts)
            print(f"round {r + 1} {side} done, load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    from zkit.models.gpt import GPTConfig

    psi = GPTConfig(vocab_size=8192, seq_len=128, n_layer=args.layers, n_head=max(1, args.d_model // 64),
                    d_model=args.d_model).num_parameters()
    print(f"\nCPU offload overhead, GPT {psi / 1e6:.1f}M params, 2 ranks x 1 thread, fp32, "
          f"{args.rounds} rounds x {args.steps} steps; load average {min(loads):.1f}-{max(loads):.1f}")
    print("| stage | " + " | ".join(f"{s} no offload s | {s} cpu offload s | {s} ratio" for s in sides) + " |")
    print("|---|" + "---|---|---|" * len(sides))
    for stage in (2, 3):
        cells = []
        for s in sides:
            base = statistics.median(samples[s][f"{stage}-none"])
            off = statistics.median(samples[s][f"{stage}-cpu"])
            cells += [f"{base:.3f}", f"{off:.3f}", f"{off / base:.2f}"]
        print(f"| {stage} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
