"""DeepSpeed's ZeRO stages as benchmark contestants, run in DeepSpeed's own interpreter.

DeepSpeed pins its own dependencies, so it usually lives in a separate virtual environment. The
benchmark starts this file there as a subprocess (see :func:`deepspeed_command`); it spawns the
gloo ranks itself and prints one JSON line with the results. It trains the same GPT from the same
seed on the same batches as zkit (:mod:`zero_workloads`), with the same config dict
(:func:`zero_torch_side.zkit_config` is DeepSpeed's format) and the same optimizer kernel (torch's
fused AdamW, passed as a client optimizer, so the comparison is of the ZeRO machinery, not of Adam
implementations)::

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python contrib/bench/zero_deepspeed_side.py \
        --mode speed --world 2 --stages 0,1,2,3 --workload '{"preset": "medium"}'
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT_PREFIX = "ZERO_BENCH_RESULT "


def deepspeed_command(python: str, args: list[str], shim_dir: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run this file under DeepSpeed's interpreter.

    zkit is not installed there; the repository goes on ``PYTHONPATH`` for :mod:`zkit.models.gpt`,
    with ``shim_dir`` holding links to zkit's pure-Python dependencies (pluggy, attrs) taken from
    this interpreter, so DeepSpeed's environment is used as it is and never modified."""
    for name in ("pluggy", "attr", "attrs"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"zkit's dependency {name!r} is not importable here; it is needed by the DeepSpeed side")
        link = os.path.join(shim_dir, name)
        if not os.path.exists(link):
            os.symlink(os.path.dirname(spec.origin), link)
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([shim_dir, REPO, HERE]),
        OMP_NUM_THREADS="1",
        PYTHONNOUSERSITE="1",
        PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning",
    )
    return [python, os.path.abspath(__file__), *args], env


def _build(w: Any, stage: int) -> tuple[Any, Any]:
    import deepspeed
    import torch

    from zero_torch_side import zkit_config
    from zero_workloads import ADAMW, build_model

    cfg = zkit_config(w, stage)
    cfg.pop("optimizer")
    cfg.pop("seed")
    cfg["wall_clock_breakdown"] = False
    # stage 3: built under DeepSpeed's zero.Init, each rank holding only its shard from the start
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=stage == 3):
        model = build_model(w)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)

    def step(batch: Any) -> None:
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()

    return engine, step


def _close(engine: Any) -> None:
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()


def speed_round_ranks(w_json: dict[str, Any], stages: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from zero_workloads import Workload, timed_steps

    torch.set_num_threads(1)
    w = Workload.from_json(w_json)
    out: dict[str, Any] = {}
    for stage in stages:
        name = f"DeepSpeed ZeRO-{stage}"
        engine = None
        try:
            engine, step = _build(w, stage)
            out[name] = timed_steps(w, step)
        except Exception as exc:  # noqa: BLE001 - a failing contestant is a table entry
            if dist.get_rank() == 0:
                traceback.print_exc()
            out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            dist.barrier()
        finally:
            if engine is not None:
                _close(engine)
            engine = step = None
            gc.collect()
    return out


def train_ranks(w_json: dict[str, Any], stage: int, rss_cap: int) -> dict[str, Any]:
    """Train ``timed_steps`` steps under a resident-set cap (scale mode)."""
    import torch

    from zero_workloads import RssGuard, Workload, peak_rss_bytes, timed_steps

    torch.set_num_threads(1)
    guard = RssGuard(rss_cap)
    try:
        w = Workload.from_json(w_json)
        engine, step = _build(w, stage)
        times = timed_steps(w, step)
        _close(engine)
        return {"times": times, "peak_rss": peak_rss_bytes()}
    finally:
        guard.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("speed", "train", "rest"), required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (speed mode)")
    p.add_argument("--stage", type=int, default=0, help="the one stage to train (train mode)")
    p.add_argument("--rss-cap", type=int, default=0, help="per-rank resident-set cap in bytes (train mode)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--workload", required=True, help="JSON of zero_workloads.Workload fields")
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    from zkit.testing import run_ranks

    w_json = json.loads(args.workload)
    stages = [int(s) for s in args.stages.split(",") if s]
    if args.mode == "speed":
        results = run_ranks(speed_round_ranks, args.world, args=(w_json, stages), timeout=args.timeout)
    elif args.mode == "rest":
        from bench_memory_at_rest import rest_ranks

        results = run_ranks(rest_ranks, args.world, args=("deepspeed", w_json, stages), timeout=args.timeout)
    else:
        results = run_ranks(train_ranks, args.world, args=(w_json, args.stage, args.rss_cap), timeout=args.timeout)
    print(RESULT_PREFIX + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
