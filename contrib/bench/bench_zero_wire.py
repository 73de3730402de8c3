"""Bytes on the wire per ZeRO stage: the operating system's interface counters against the
communicator's own bookkeeping (``engine.comm_stats()``) and the ring formula.

Each rank runs in a network namespace of its own, joined through a bridge namespace
(:class:`bench_onebit_slowlink.SlowNetwork`, ports shaped at ``--rate``), so every byte a rank sends
crosses its ``eth0`` and shows in that namespace's ``/proc/net/dev``. The script creates and
deletes the namespaces itself (it needs root; without it, it says so and exits). Per stage: one
warm-up step, then ``--steps`` steps between two readings of the counters::

    sudo .venv/bin/python contrib/bench/bench_zero_wire.py --world 2 --steps 3

The OS counts what TCP/IP adds (headers, acknowledgements) and gloo's own messages (rendezvous
excluded: the counters are read after initialize); the bookkeeping counts tensor payloads only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PORT = 29651


def tx_bytes(dev: str = "eth0") -> int:
    """Bytes this namespace sent on ``dev`` (``/proc/net/dev``: the 9th field after the name)."""
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    raise RuntimeError(f"no interface {dev} in /proc/net/dev")


def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import zkit
    from zkit.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, seq_len=32))
    psi = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1_000_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 1_000_000, "overlap_comm": True,
                                 "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    batch = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(args.rank))

    def step() -> None:
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()

    step()  # warm-up: stage 3 records its module order
    dist.barrier()
    before_os, before_book = tx_bytes(), sum(v["bytes"] for v in engine.comm_stats().values())
    for _ in range(args.steps):
        step()
    dist.barrier()
    after_os, after_book = tx_bytes(), sum(v["bytes"] for v in engine.comm_stats().values())
    engine.close()
    with open(f"{args.result}.{args.rank}", "w") as f:
        json.dump({"os": (after_os - before_os) / args.steps, "book": (after_book - before_book) / args.steps,
                   "psi": psi}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("bench_zero_wire: needs root and the ip/tc tools (iproute2) to build its network namespaces")
    from bench_onebit_slowlink import SlowNetwork

    print(f"{'stage':>5} {'params':>8} | {'OS tx MB/step':>13} {'book MB/step':>12} {'OS/book':>7} | "
          f"{'ring formula MB':>15} {'book/formula':>12}")
    with tempfile.TemporaryDirectory() as tmp, SlowNetwork(args.world, args.rate) as net:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
        for stage in (int(s) for s in args.stages.split(",")):
            result = os.path.join(tmp, f"stage{stage}")
            procs = [
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--worker",
                     "--stage", str(stage), "--rank", str(r), "--world-size", str(args.world),
                     "--master", net.address(0), "--preset", args.preset, "--steps", str(args.steps),
                     "--timeout", str(args.timeout), "--result", result],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for r, ns in enumerate(net.ranks)
            ]
            outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise RuntimeError(f"stage {stage}: a rank failed:\n{outs[0][-3000:]}\n{outs[-1][-3000:]}")
            rows = []
            for r in range(args.world):
                with open(f"{result}.{r}") as f:
                    rows.append(json.load(f))
            os_tx = max(row["os"] for row in rows)
            book = max(row["book"] for row in rows)
            psi, n = rows[0]["psi"], args.world
            # ring volume per rank per step, fp32: all-reduce 2Ψ(n-1)/n; stage 3 adds one more gather
            formula = 4 * psi * (n - 1) / n * (3 if stage == 3 else 2)
            print(f"{stage:>5} {psi / 1e6:>7.1f}M | {os_tx / 1e6:>13.2f} {book / 1e6:>12.2f} {os_tx / book:>7.3f} | "
                  f"{formula / 1e6:>15.2f} {book / formula:>12.3f}")
    print("OS: bytes sent on the rank's interface (largest rank); book: engine.comm_stats() (tensor payloads)")


if __name__ == "__main__":
    main()
