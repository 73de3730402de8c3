"""ZeRO stage 3's host cost per unit kind, against plain PyTorch and FSDP2, counted on the CPU.

Each contestant trains ``bench_gpu_contestants.py``'s GPT at a tiny shape (24 layers, width 64, 4
heads, vocabulary 512, 64 tokens, micro-batch 2) in a process group of its own; after 3 warm-up
steps a ``TorchDispatchMode`` counts the aten ops of one step (about one kernel launch each on a
GPU) and the host-device syncs among them, then the median thread time of ``--steps`` steps is
taken. Contestants: plain PyTorch (autocast bf16, fused AdamW), FSDP2 per block (world size 1
only: its mesh is one rank), and zkit stage 3 with ``stage3_gather_unit`` "block" and "module",
at the default ``stage3_param_persistence_threshold`` (at this width every parameter is under it:
nothing is gathered per step) and at 0 (every block gathered in forward and backward)::

    OMP_NUM_THREADS=1 python contrib/bench/bench_stage3_units.py --worlds 1 2     # about 3 minutes

Counts are deterministic; times are the loaded machine's (thread time: steadier than wall time).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "BENCH_STAGE3_RESULT "
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal"}
#: (label, contestant, stage3_gather_unit, stage3_param_persistence_threshold)
CONTESTANTS = [
    ("plain PyTorch", "torch", None, None),
    ("FSDP2 per block", "fsdp2", None, None),
    ("zkit-3 module", "zkit-3", "module", None),
    ("zkit-3 block", "zkit-3", "block", None),
    ("zkit-3 module, persistence 0", "zkit-3", "module", 0),
    ("zkit-3 block, persistence 0", "zkit-3", "block", 0),
]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import bench_gpu_contestants as contestants
    from bench_gpu_model import Shape

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*a, **(kw or {}))

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    shape = Shape(layers=24, width=64, heads=4, vocab=512, seq=64)
    torch.manual_seed(0)
    if args.contestant == "zkit-3":
        cfg = contestants.zkit_config("zkit-3", 2, args.dtype, None, args.persistence)
        cfg["zero_optimization"]["stage3_gather_unit"] = args.unit
        step = contestants._zkit(cfg, shape, None)
    else:
        step = contestants.build(args.contestant, shape, 2, args.dtype, torch.device("cpu"), None, "inductor")
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        step(ids)
    count = Count()
    with count:
        step(ids)
    times = []
    for _ in range(args.steps):
        start = time.thread_time()
        step(ids)
        times.append(time.thread_time() - start)
    if args.rank == 0:
        print(RESULT + json.dumps({"ops": sum(count.ops.values()), "syncs": sum(count.ops[s] for s in SYNC_OPS),
                                   "ms": 1e3 * statistics.median(times)}), flush=True)
    if hasattr(step, "engine"):
        step.engine.close()
    dist.destroy_process_group()


def run(contestant: str, unit: str | None, persistence: int | None, world: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--worker", "--contestant", contestant, "--unit", str(unit), "--port", str(port),
           "--world", str(world), "--dtype", args.dtype, "--steps", str(args.steps)]
    if persistence is not None:
        cmd += ["--persistence", str(persistence)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=env) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{contestant} ({unit}, persistence {persistence}) at world size {world} failed")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--contestant", "--unit"):
        p.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--persistence", "--port", "--rank", "--world"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    base = run("torch", None, None, 1, args)
    print(f"{args.dtype}; x: against plain PyTorch's one process\n")
    print("| contestant | world size | aten ops per step | x | syncs per step | host ms per step (thread) | x |")
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for label, contestant, unit, persistence in CONTESTANTS:
            if contestant != "zkit-3" and world > 1:
                continue  # the references run as one process
            r = base if contestant == "torch" else run(contestant, unit, persistence, world, args)
            print(f"| {label} | {world} | {r['ops']} | {r['ops'] / base['ops']:.2f} | {r['syncs']} | "
                  f"{r['ms']:.1f} | {r['ms'] / base['ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
