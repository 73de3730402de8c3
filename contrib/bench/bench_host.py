"""What a training step costs the host, side by side in one run: plain PyTorch (DDP over two
ranks), FSDP2, DeepSpeed and zkit's stages and offloads, counted on the CPU.

Every contestant trains ``bench_gpu_model.PlainGPT`` (by default 24 layers, width 64, 4 heads,
vocabulary 512, 64 tokens, micro-batch 2: a model so small that the framework *is* the step) with
AdamW, in bf16 (plain PyTorch and DDP under ``torch.autocast``, the others with bf16 parameters
and an fp32 master) and in fp32, at world size 1 and 2 (gloo ranks, one thread each). Each
contestant runs in a process of its own; DeepSpeed 0.19.8 in its own interpreter
(``--deepspeed-python``, the peers environment). Per contestant, on rank 0, after ``--warmup``
steps:

* **ops**: the ops one steady-state step dispatches, counted by a ``TorchDispatchMode``
  (:mod:`zkit.step_counts`): on a GPU about one kernel launch each;
* **syncs**: ``_local_scalar_dense`` / ``is_nonzero`` / ``nonzero`` / ``equal`` on tensors that
  would be device-resident in a GPU run, i.e. every tensor but an offloaded optimizer's state,
  its fp32 master and that master's gradients (those reads are **host reads**: they wait for
  nothing, but still go through a tensor);
* **collectives**: the c10d ops the step dispatched;
* **host ms**: the median ``time.thread_time()`` of ``--steps`` steps (CPU time of the calling
  thread, steadier than wall time on a shared machine).

Ratios are to plain PyTorch at world size 1 and to DDP at 2, same dtype::

    python contrib/bench/bench_host.py --deepspeed-python .venv-peers/bin/python --out /tmp/bench_host
    python contrib/bench/bench_host.py --smoke          # 2 layers, zkit and torch only: seconds
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
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "BENCH_HOST_RESULT "
TORCH_SIDE = ("torch", "fsdp2", "zkit-0", "zkit-1", "zkit-2", "zkit-3", "zkit-2-offload", "zkit-3-offload")
DEEPSPEED_SIDE = ("ds-0", "ds-1", "ds-2", "ds-3", "ds-2-offload", "ds-3-offload")
ALL = TORCH_SIDE + DEEPSPEED_SIDE
SHAPE = dict(layers=24, width=64, heads=4, vocab=512, seq=64)
SMOKE = dict(layers=2, width=64, heads=4, vocab=512, seq=64)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contestants", default=",".join(ALL), help=f"comma-separated, from {', '.join(ALL)}")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--layers", type=int, default=SHAPE["layers"])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--deepspeed-python", default=None,
                   help="the interpreter of an environment with DeepSpeed (the ds-* contestants; skipped without)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--smoke", action="store_true", help="2 layers, 1 step timed: a check of the paths, no figures")
    p.add_argument("--out", default=None, help="folder for bench_host.md and bench_host.json")
    args = p.parse_args(argv)
    args.names = [n for n in args.contestants.split(",") if n]
    unknown = sorted(set(args.names) - set(ALL))
    if unknown:
        p.error(f"unknown contestants {', '.join(unknown)}; choose from {', '.join(ALL)}")
    args.dtype_list = [d for d in args.dtypes.split(",") if d]
    args.world_list = [int(w) for w in args.worlds.split(",") if w]
    if args.smoke:
        args.layers, args.warmup, args.steps = SMOKE["layers"], 2, 1
    return args


def shape_json(layers: int) -> dict[str, int]:
    return dict(SHAPE, layers=layers)


# -- on each rank -----------------------------------------------------------------------------------
def measure(step: Callable[[Any], Any], batches: list[Any], warmup: int, steps: int,
            host_resident: Callable[[Any], bool] | None) -> dict[str, Any]:
    """Warm up, count one step, time ``steps`` more (thread CPU time)."""
    from zkit.step_counts import count_step

    for ids in batches[:warmup]:
        step(ids)
    counts, _ = count_step(lambda: step(batches[warmup]), host_resident)
    times = []
    for ids in batches[warmup + 1 : warmup + 1 + steps]:
        t = time.thread_time()
        step(ids)
        times.append(time.thread_time() - t)
    return {"ops": counts.ops, "syncs": counts.syncs, "host_reads": counts.host_reads,
            "collectives": counts.collectives, "syncs_by_op": counts.syncs_by_op,
            "by_op": counts.by_op, "host_ms": 1e3 * statistics.median(times)}


def batches_for(shape: Any, micro_batch: int, count: int, rank: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1 + rank)
    return [torch.randint(0, shape.vocab, (micro_batch, shape.seq), generator=g) for _ in range(count)]


def torch_side_rank(name: str, dtype: str, shape: dict[str, int], micro_batch: int, warmup: int,
                    steps: int) -> dict[str, Any]:
    """One torch-side contestant on this rank."""
    import torch.distributed as dist

    from bench_gpu_model import Shape
    from bench_host_contestants import build_torch_side

    s = Shape(**shape)
    step, host_resident, close = build_torch_side(name, s, micro_batch, dtype)
    try:
        return measure(step, batches_for(s, micro_batch, warmup + 1 + steps, dist.get_rank()), warmup, steps,
                       host_resident)
    finally:
        close()


# -- the driver ---------------------------------------------------------------------------------------
def run_torch_side(name: str, dtype: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import bench_host
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    try:
        out = run_ranks(bench_host.torch_side_rank, world,
                        args=(name, dtype, shape_json(args.layers), args.micro_batch, args.warmup, args.steps),
                        timeout=args.timeout, start="forkserver", env={"PYTHONWARNINGS": "ignore"})
    except (RanksFailed, RanksTimedOut) as exc:
        return {"error": str(exc).strip().splitlines()[-1][:300]}
    return out[0]


def run_deepspeed_side(names: list[str], dtype: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from zero_deepspeed_side import deepspeed_command

    shim = tempfile.mkdtemp(prefix="bench_host_shim_")
    cmd, env = deepspeed_command(args.deepspeed_python, [], shim)
    cmd = [cmd[0], os.path.join(HERE, "bench_host_deepspeed.py"), "--names", ",".join(names), "--dtype", dtype,
           "--world", str(world), "--shape", json.dumps(shape_json(args.layers)), "--micro-batch",
           str(args.micro_batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--timeout", str(args.timeout)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout * len(names))
    except subprocess.TimeoutExpired:
        return {n: {"error": "timed out"} for n in names}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {n: {"error": tail[:300]} for n in names}


def run_all(args: argparse.Namespace) -> dict[tuple[str, int, str], dict[str, Any]]:
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    results: dict[tuple[str, int, str], dict[str, Any]] = {}
    for world in args.world_list:
        for dtype in args.dtype_list:
            for name in [n for n in args.names if n in TORCH_SIDE]:
                r = results[(dtype, world, name)] = run_torch_side(name, dtype, world, args)
                log(f"  {dtype} world {world} {name:15s} " + (r.get("error") or
                    f"{r['ops']} ops, {r['syncs']} syncs, {r['host_ms']:.1f} ms"))
            ds = [n for n in args.names if n in DEEPSPEED_SIDE]
            if ds and args.deepspeed_python:
                for name, r in run_deepspeed_side(ds, dtype, world, args).items():
                    results[(dtype, world, name)] = r
                    log(f"  {dtype} world {world} {name:15s} " + (r.get("error") or
                        f"{r['ops']} ops, {r['syncs']} syncs, {r['host_ms']:.1f} ms"))
    return results


LABELS = {
    "torch": "plain PyTorch (autocast bf16 / fp32, AdamW fused); DDP at world 2",
    "fsdp2": "FSDP2, fully_shard per block",
    "zkit-0": "zkit stage 0", "zkit-1": "zkit stage 1", "zkit-2": "zkit stage 2", "zkit-3": "zkit stage 3",
    "zkit-2-offload": "zkit stage 2, offload_optimizer cpu",
    "zkit-3-offload": "zkit stage 3, optimizer and parameters on cpu",
    "ds-0": "DeepSpeed 0.19.8 stage 0", "ds-1": "DeepSpeed stage 1", "ds-2": "DeepSpeed stage 2",
    "ds-3": "DeepSpeed stage 3", "ds-2-offload": "DeepSpeed stage 2, offload_optimizer cpu",
    "ds-3-offload": "DeepSpeed stage 3, optimizer and parameters on cpu",
}


def table(results: dict[tuple[str, int, str], dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for dtype in args.dtype_list:
        for world in args.world_list:
            base = results.get((dtype, world, "torch"), {})
            lines += [f"\n{dtype}, world size {world}\n",
                      "| contestant | ops per step | x plain | syncs | host reads | collectives | host ms | x plain |",
                      "|---|---|---|---|---|---|---|---|"]
            for name in args.names:
                r = results.get((dtype, world, name))
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {LABELS[name]} | {r['error']} | | | | | | |")
                    continue
                ops_x = f"{r['ops'] / base['ops']:.2f}" if "ops" in base else ""
                ms_x = f"{r['host_ms'] / base['host_ms']:.2f}" if "host_ms" in base else ""
                lines.append(f"| {LABELS[name]} | {r['ops']} | {ops_x} | {r['syncs']} | {r['host_reads']} | "
                             f"{r['collectives']} | {r['host_ms']:.1f} | {ms_x} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [HERE, REPO]
    args = parse(argv)
    results = run_all(args)
    text = table(results, args)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_host.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench_host.json"), "w") as f:
            json.dump({"|".join(map(str, k)): v for k, v in results.items()}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
