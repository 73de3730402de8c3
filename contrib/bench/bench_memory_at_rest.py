"""Memory at rest: live tensor bytes per rank after a step, zkit against DeepSpeed, same script.

Both sides train the same GPT from the same seed with the same config (the defaults, bucket sizes
included) and the same client optimizer (torch's AdamW), take two steps, then count the bytes of
every tensor storage alive in the rank (:func:`zkit.telemetry.live_tensors.live_tensor_bytes`: a walk
over the garbage collector's objects, not any allocator's bookkeeping) and the resident set. The
peak during the step is the resident set's high-water mark. ::

    .venv/bin/python contrib/bench/bench_memory_at_rest.py --deepspeed-python .venv-peers/bin/python

DeepSpeed runs in its own interpreter (``zero_deepspeed_side.py --mode rest``); without
``--deepspeed-python`` only zkit's rows are printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, REPO]

from zero_workloads import Workload  # noqa: E402


def rest_config(w: Workload, stage: int) -> dict[str, Any]:
    """The config both sides get: batch, stage and precision; every other key at its default."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }
    if w.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def rest_ranks(side: str, w_json: dict[str, Any], stages: list[int]) -> dict[str, Any]:
    """On one rank: per stage, live tensor bytes and RSS after two steps, and the peak RSS."""
    import torch

    from zero_workloads import ADAMW, batches, build_model, peak_rss_bytes, rss_bytes
    from zkit.telemetry.live_tensors import live_tensor_bytes

    torch.set_num_threads(1)
    w = Workload.from_json(w_json)
    out: dict[str, Any] = {}
    for stage in stages:
        model = build_model(w)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        if side == "zkit":
            import zkit as lib
        else:
            import deepspeed as lib
        kwargs = {} if side == "zkit" else {"dist_init_required": False}
        engine, *_ = lib.initialize(model=model, optimizer=opt, config=rest_config(w, stage), **kwargs)
        del model, opt
        for batch in batches(w, torch.distributed.get_rank(), 2):
            loss = engine(batch, batch)
            engine.backward(loss)
            engine.step()
        del loss
        gc.collect()
        out[str(stage)] = {"live": live_tensor_bytes(), "rss": rss_bytes(), "peak_rss": peak_rss_bytes()}
        close = getattr(engine, "close", None) or getattr(engine, "destroy", None)
        if close is not None:
            close()
        del engine
        gc.collect()
    return out


def run_deepspeed(python: str, w: Workload, stages: list[int], world: int) -> list[dict[str, Any]]:
    from zero_deepspeed_side import RESULT_PREFIX, deepspeed_command

    with tempfile.TemporaryDirectory() as shim:
        cmd, env = deepspeed_command(
            python,
            ["--mode", "rest", "--world", str(world), "--stages", ",".join(map(str, stages)),
             "--workload", json.dumps(w.to_json())],
            shim,
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"the DeepSpeed side printed no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="GPT preset (zkit.models.gpt.PRESETS)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--deepspeed-python", default=None, help="interpreter of an environment with DeepSpeed")
    args = p.parse_args(argv)
    from zkit.testing import run_ranks

    stages = [int(s) for s in args.stages.split(",")]
    print(f"{'dtype':5} {'stage':5} {'params':>9} | {'zkit live/Ψ':>11} {'DS live/Ψ':>9} {'ratio':>6} | "
          f"{'zkit RSS':>9} {'DS RSS':>9} | {'zkit peak':>9} {'DS peak':>9}")
    for dtype in args.dtypes.split(","):
        w = Workload(preset=args.preset, dtype=dtype, micro_batch=2, seq_len=128)
        psi = w.num_parameters()
        for stage in stages:  # each stage in fresh processes: nothing of another stage stays alive
            zk = run_ranks(rest_ranks, args.world, args=("zkit", w.to_json(), [stage]), timeout=1800)
            ds = run_deepspeed(args.deepspeed_python, w, [stage], args.world) if args.deepspeed_python else None
            z = max(r[str(stage)]["live"] for r in zk)
            d = max(r[str(stage)]["live"] for r in ds) if ds else float("nan")
            zr = max(r[str(stage)]["rss"] for r in zk) / 2**20
            dr = max(r[str(stage)]["rss"] for r in ds) / 2**20 if ds else float("nan")
            zp = max(r[str(stage)]["peak_rss"] for r in zk) / 2**20
            dp = max(r[str(stage)]["peak_rss"] for r in ds) / 2**20 if ds else float("nan")
            print(f"{dtype:5} {stage:5} {psi:>9} | {z / psi:>11.2f} {d / psi:>9.2f} {z / d:>6.2f} | "
                  f"{zr:>7.0f}Mi {dr:>7.0f}Mi | {zp:>7.0f}Mi {dp:>7.0f}Mi")
    print("live/Ψ: bytes of live tensor storages per model parameter, largest rank; RSS after the step; "
          "peak: the rank's resident high-water mark")
    return 0


if __name__ == "__main__":
    sys.exit(main())
