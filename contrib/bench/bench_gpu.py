"""One GPU: ZeRO against plain PyTorch and FSDP2, side by side in one run.

Every contestant (``bench_gpu_contestants.py``) trains the same plain-``nn.Module`` GPT
(``bench_gpu_model.py``; by default 24 layers, width 1024, vocabulary 32000: 369M parameters) on
micro-batches of 8 x 1024 tokens with AdamW, alone in a process of its own, world size 1. Reported
per contestant: the median step time of ``--steps`` steps after ``--warmup`` (the device
synchronised around each step), its ratio to plain PyTorch's, the model's TFLOP/s at that time
(6 FLOPs per parameter per token plus attention), the device's peak allocation
(``torch.cuda.max_memory_allocated``) and the process's peak RSS. For the offloaded contestants
also the bound of their step (``bench_gpu_bound.py``: device compute, host-device transfers over
the pinned bandwidth measured in this run, the host optimizer's step alone) and the step's ratio
to it. ``--trace`` writes a ``torch.profiler`` trace of one step per contestant and the share of
that step the device spent in kernels; the traces show zkit's phases and ZeRO-3's per-module
gathers and releases as named ranges (``zkit.core.profiling``)::

    python contrib/bench/bench_gpu.py --out /tmp/bench_gpu --trace          # one H100: ~6 minutes
    python contrib/bench/bench_gpu.py --cpu-smoke --out /tmp/smoke         # no GPU: a tiny model, seconds

The table goes to stdout and, with ``--out``, as ``bench_gpu.md``, ``bench_gpu.csv`` and (with
matplotlib) ``bench_gpu.png`` into that folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "BENCH_GPU_RESULT "
#: the CPU smoke run's model and batch: every code path, in seconds
SMOKE = dict(layers=2, width=64, heads=4, vocab=512, seq=64, micro_batch=2, warmup=1, steps=3, dtype="fp32", jobs=2,
             stage3_persistence_threshold=0, compile=True, compile_backend="aot_eager")


def parse(argv: list[str] | None) -> argparse.Namespace:
    from bench_gpu_contestants import ALL, BASE, OFFLOADED

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contestants", default=",".join(BASE + OFFLOADED),
                   help=f"comma-separated, from {', '.join(ALL)} (the default: all but the compiled ones)")
    p.add_argument("--compile", action="store_true", help="add the torch.compile contestants")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--nvme-dir", default=None,
                   help="a folder on a local disk for zkit-3-nvme (default: the temporary folder when it is on a "
                        "disk, not in memory)")
    p.add_argument("--out", default=None, help="folder for the table (.md, .csv, .png) and traces")
    p.add_argument("--trace", action="store_true", help="a torch.profiler trace of one step per contestant")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per contestant")
    p.add_argument("--jobs", type=int, default=1, help="contestants run at once (more than 1: no figures)")
    p.add_argument("--stage3-persistence-threshold", type=int, default=None,
                   help="zero_optimization.stage3_param_persistence_threshold (default: zkit's)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny model on the CPU, every contestant that runs there (a check of the paths, no figures)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        for key, value in SMOKE.items():
            if p.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    names = [n for n in args.contestants.split(",") if n]
    if args.compile:
        from bench_gpu_contestants import COMPILED

        names += [n for n in COMPILED if n not in names]
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        p.error(f"unknown contestants {', '.join(unknown)}; choose from {', '.join(ALL)}")
    args.names = names
    return args


def shape_of(args: argparse.Namespace):
    from bench_gpu_model import Shape

    return Shape(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq)


# -- one contestant, in its own process ------------------------------------------------------------
def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench_gpu_contestants import build
    from zero_workloads import peak_rss_bytes

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    torch.set_num_threads(1 if args.cpu_smoke else os.cpu_count() or 1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    own_group = not dist.is_initialized()  # a forked smoke child runs in zkit.testing's group
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    shape = shape_of(args)
    if args.child == "bound":
        from bench_gpu_bound import measure

        return measure(shape, args.micro_batch, args.dtype, device, max(3, args.steps // 2))
    step = build(args.child, shape, args.micro_batch, args.dtype, device, args.nvme_dir, args.compile_backend,
                 args.stage3_persistence_threshold)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, shape.vocab, (args.micro_batch, shape.seq), generator=g).to(device)
               for _ in range(args.warmup + args.steps)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, times = [], []
    for i, ids in enumerate(batches):
        sync()
        t = time.perf_counter()
        losses.append(step(ids))
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    out: dict[str, Any] = {"times": times, "losses": [float(x) for x in losses]}
    if device.type == "cuda":
        out["peak_device"] = torch.cuda.max_memory_allocated()
    if args.trace:
        from bench_gpu_trace import trace_step

        out.update(trace_step(step, batches[-1], device, os.path.join(args.out, f"trace_{args.child}.json")))
    out["peak_rss"] = peak_rss_bytes()
    engine = getattr(step, "engine", None)
    if engine is not None:
        engine.close()
    if own_group:
        dist.destroy_process_group()
    return out


def forked_child(argv: list[str], name: str) -> dict[str, Any]:
    """:func:`child` in a process forked from a server that imported torch once (the smoke run:
    a new interpreter per contestant would spend most of it importing)."""
    return child(parse([*argv, "--child", name]))


def run_child(name: str, argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu_smoke:
        return run_forked(name, argv, args)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.cpu_smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke run is the CPU's, on any machine
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT):]), wall_s=time.perf_counter() - started)
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {"error": tail[:300], "stderr": proc.stderr[-4000:]}


def run_forked(name: str, argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The smoke run's contestant: its own process, forked from zkit.testing's forkserver."""
    import bench_gpu  # this file by its module name, so the forked process finds the function
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    started = time.perf_counter()
    try:
        (out,) = run_ranks(bench_gpu.forked_child, 1, args=(argv, name), timeout=args.timeout, start="forkserver",
                           env={"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"})
    except (RanksFailed, RanksTimedOut) as exc:
        return {"error": str(exc).strip().splitlines()[-1][:300]}
    return dict(out, wall_s=time.perf_counter() - started)


def local_disk_dir(path: str | None) -> tuple[str | None, str]:
    """A folder for NVMe offload, or None and why not: the given one, else the temporary folder
    unless it is in memory (tmpfs), where 'offload to disk' would be offload to host memory."""
    if path:
        os.makedirs(path, exist_ok=True)
        return path, ""
    tmp = tempfile.gettempdir()
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind, *_ = line.split()
            if (tmp + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best):
                best, fstype = mount, kind
    if fstype in ("tmpfs", "ramfs"):
        return None, f"{tmp} is {fstype}: give --nvme-dir on a local disk"
    return tempfile.mkdtemp(prefix="bench_gpu_nvme_", dir=tmp), ""


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [HERE, REPO]
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child:
        try:
            out = child(args)
        except Exception as exc:  # noqa: BLE001 - the parent reports it as this contestant's row
            import traceback

            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(RESULT + json.dumps(out), flush=True)
        return 0
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device; --cpu-smoke runs its paths on the CPU", file=sys.stderr)
        return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    elif args.trace:
        args.out = tempfile.mkdtemp(prefix="bench_gpu_")
    from bench_gpu_bound import TRANSFER_BYTES
    from bench_gpu_report import describe_machine, report

    nvme_dir, no_disk = local_disk_dir(args.nvme_dir) if "zkit-3-nvme" in args.names else (None, "")
    child_argv = [a for a in argv if a != "--compile"]
    if nvme_dir:
        child_argv += ["--nvme-dir", nvme_dir]
    if args.trace and "--out" not in argv:
        child_argv += ["--out", args.out]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    machine = describe_machine(args.cpu_smoke)
    log(machine)

    def one(name: str) -> dict[str, Any]:
        if name == "zkit-3-nvme" and not nvme_dir:
            return {"error": f"skipped: {no_disk}"}
        r = run_child(name, child_argv, args)
        log(f"  {name:16s} " + (r["error"] if "error" in r else
                                f"median {1e3 * sorted(r['times'])[len(r['times']) // 2]:.1f} ms, "
                                f"{r['wall_s']:.0f} s in all"))
        return r

    # one contestant at a time, unless told otherwise (the smoke run's times are no figures)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(args.names, pool.map(one, args.names)))
    bound = None
    if any(n in TRANSFER_BYTES for n in args.names):
        bound = run_child("bound", child_argv, args)
        log("  bound parts      " + (bound["error"] if "error" in bound else "measured"))
    report(results, bound, args, shape_of(args), machine)
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
