"""Step time on a slow link, Adam vs 1-bit Adam.

Each rank runs in its own network namespace; the namespaces hang off a bridge (in a namespace of
its own), each port shaped with ``tc ... tbf`` in both directions, like a switch with slow ports.
Traffic stays between these namespaces, which this script creates and deletes itself (it needs
root; without root, or without ``ip``/``tc``, it says so and exits). The model is a wide MLP at a
tiny batch, so the gradient exchange dominates the step.

    sudo python contrib/bench/bench_onebit_slowlink.py --rates 100mbit 1gbit --world 2 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: RFC 2544's benchmarking range: addresses of this benchmark's own namespaces only.
SUBNET = "198.18.0"
PORT = 29650


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class SlowNetwork:
    """``world`` namespaces joined through a bridge namespace; every port limited to ``rate``."""

    def __init__(self, world: int, rate: str) -> None:
        tag = f"zob{os.getpid() % 100000}"
        self.bridge = f"{tag}-br"
        self.ranks = [f"{tag}-r{r}" for r in range(world)]
        self.rate = rate

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> "SlowNetwork":
        try:
            sh("ip", "netns", "add", self.bridge)
            sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for r, ns in enumerate(self.ranks):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{r}", "netns", self.bridge)
                sh("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", self.bridge, "link", "set", f"p{r}", "master", "br0")
                sh("ip", "-n", self.bridge, "link", "set", f"p{r}", "up")
                for where, dev in ((ns, "eth0"), (self.bridge, f"p{r}")):
                    sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                       "burst", "32kbit", "latency", "50ms")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.ranks, self.bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def launch(net: SlowNetwork, optimizer: str, args, out_dir: str) -> list[dict]:
    world = len(net.ranks)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
    result = os.path.join(out_dir, f"{optimizer}.json")
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--worker",
             "--rank", str(r), "--world-size", str(world), "--master", net.address(0),
             "--optimizer", optimizer, "--width", str(args.width), "--warmup", str(args.warmup),
             "--timed", str(args.timed), "--result", result],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r, ns in enumerate(net.ranks)
    ]
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed:\n{outputs[0][-3000:]}\n{outputs[-1][-3000:]}")
    with open(result) as f:
        return json.load(f)


def worker(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import zkit
    from bench_onebit_common import config_for, mlp_batch, mse_loss, train_steps, wide_mlp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank, world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    model = wide_mlp(args.width)
    steps = args.warmup + args.timed
    engine, *_ = zkit.initialize(model=model, config=config_for(args.optimizer, 1e-4, args.warmup, 0, micro_batch=4))
    rows = train_steps(engine, lambda s: mlp_batch(s, args.rank, args.width, 4), steps, mse_loss)
    engine.close()
    if args.rank == 0:
        for row in rows:
            row["timed"] = row["step"] > args.warmup
            row["params"] = sum(p.numel() for p in model.parameters())
        with open(args.result, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2, help="1-bit Adam's freeze_step (untimed steps)")
    ap.add_argument("--timed", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="runs/bench_onebit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        print("skipped: this benchmark needs root and the ip and tc tools to build its network namespaces")
        return
    from bench_onebit_common import write_csv

    print("| link | ranks | params | Adam s/step | 1-bit Adam s/step (compressed) | speed-up | Adam MB/step | 1-bit MB/step |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for world in args.world:
            with tempfile.TemporaryDirectory() as tmp, SlowNetwork(world, rate) as net:
                res = {opt: launch(net, opt, args, tmp) for opt in ("Adam", "OneBitAdam")}
            rows = [dict(r, optimizer=o, rate=rate, world=world) for o, rs in res.items() for r in rs]
            write_csv(f"{args.out}/slowlink_{rate}_w{world}.csv", rows)
            t = {o: statistics.median(r["seconds"] for r in rs if r["timed"]) for o, rs in res.items()}
            mb = {o: statistics.median(r["bytes"] for r in rs if r["timed"]) / 1e6 for o, rs in res.items()}
            print(f"| {rate} | {world} | {res['Adam'][0]['params']:,} | {t['Adam']:.3f} | {t['OneBitAdam']:.3f} | "
                  f"{t['Adam'] / t['OneBitAdam']:.1f}x | {mb['Adam']:.2f} | {mb['OneBitAdam']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
