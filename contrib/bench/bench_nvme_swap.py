"""NVMe swap bandwidth: zkit-offload's NVMeSwapper against the disk's raw sequential bandwidth,
measured in the same run with ``dd`` and O_DIRECT (1 MiB blocks).

    python contrib/bench/bench_nvme_swap.py --path /mnt/nvme --size-mb 1024

Reads use O_DIRECT (when the filesystem has it) so they come from the disk, not the page cache.
Each swapper row is one file written and read back whole; the row under it moves the same bytes as
20 MiB pieces in files of their own (an NVMe optimizer step's sub-group tensors), and "both" reads
and rewrites them at once.

    python contrib/bench/bench_nvme_swap.py --path /mnt/nvme --pages

reads one file as 16 MiB pieces, three in flight, into 12 buffers reused in turn (as the
parameter store does), each set of buffers placed a different way: first written by torch on two
threads (its pages interleaved in physical memory), first touched by the disk's reads, and on huge
pages (``zkit_offload.io_memory``, what the swapper's buffers use). Rounds are interleaved.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import torch

from zkit_offload import NVMeSwapper
from zkit_offload.swap import aligned_empty


def dd(args: list[str]) -> float:
    """GB/s that dd reports (it prints bytes and seconds on stderr)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m.group(1)) / float(m.group(2)) / 1e9


def raw_bandwidth(directory: str, size_mb: int) -> tuple[float, float]:
    path = os.path.join(directory, "zkit-dd-probe")
    try:
        w = dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "oflag=direct", "conv=fsync"])
        r = dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return w, r


def swapper_bandwidth(directory: str, size_mb: int, block_size: int, threads: int, rounds: int) -> tuple[float, float]:
    n = size_mb * (1 << 20) // 4
    t = aligned_empty(n).normal_()
    out = aligned_empty(n)
    best_w = best_r = float("inf")
    with NVMeSwapper(directory, block_size=block_size, io_threads=threads) as s:
        for _ in range(rounds):
            start = time.perf_counter()
            s.write("bench", t)
            os.fsync(os.open(s.path("bench"), os.O_RDONLY)) if not s.direct else None
            best_w = min(best_w, time.perf_counter() - start)
            start = time.perf_counter()
            s.read("bench", out)
            best_r = min(best_r, time.perf_counter() - start)
        assert torch.equal(t, out)
        direct = s.direct
    nbytes = n * 4
    print(f"  swapper: block {block_size >> 10} KiB, {threads} threads, O_DIRECT={direct}")
    return nbytes / best_w / 1e9, nbytes / best_r / 1e9


def swapper_piecewise_bandwidth(directory: str, size_mb: int, piece_mb: int, block_size: int,
                                threads: int) -> tuple[float, float, float]:
    """(write, read, both at once) GB/s of the swapper moving ``size_mb`` as pieces of
    ``piece_mb`` in files of their own, as an NVMe optimizer step does (sub-group tensors): every
    piece written, then read back in order with ``threads`` pieces in flight, then read while
    the same bytes are rewritten. "Both at once" counts the bytes read and written together."""
    numel = piece_mb * (1 << 20) // 4
    count = max(1, size_mb // piece_mb)
    bufs = [aligned_empty(numel).normal_() for _ in range(2 * threads)]

    def run(ops) -> float:
        start, pending = time.perf_counter(), []
        for op in ops:
            pending.append(op())
            if len(pending) >= threads:
                pending.pop(0).wait()
        for h in pending:
            h.wait()
        return time.perf_counter() - start

    with NVMeSwapper(directory, block_size=block_size, io_threads=threads) as s:
        t_w = run([lambda i=i: s.swap_out(f"p{i}", bufs[i % threads]) for i in range(count)])
        t_r = run([lambda i=i: s.swap_in(f"p{i}", bufs[i % threads]) for i in range(count)])
        both = []
        for i in range(count):  # read piece i + 1 while piece i is rewritten, as the step pipeline does
            both.append(lambda i=i: s.swap_in(f"p{(i + 1) % count}", bufs[threads + i % threads]))
            both.append(lambda i=i: s.swap_out(f"p{i}", bufs[i % threads]))
        t_b = run(both)
    nbytes = count * numel * 4
    return nbytes / t_w / 1e9, nbytes / t_r / 1e9, 2 * nbytes / t_b / 1e9


def page_placement_bandwidth(directory: str, size_mb: int, rounds: int) -> dict[str, list[float]]:
    """Read GB/s per round of one file read as 16 MiB pieces into buffers placed three ways
    (module docstring)."""
    from zkit_offload.io_memory import small_page_empty

    piece = 16 << 20
    count = max(1, (size_mb << 20) // piece)

    def torch_pages(touch: bool) -> torch.Tensor:  # what aligned_empty gave before huge pages
        t = small_page_empty(piece).view(torch.float32)
        return t.normal_() if touch else t

    pools = {
        "4 KiB pages, written by 2 threads first": [torch_pages(True) for _ in range(12)],
        "4 KiB pages, touched by the reads first": [torch_pages(False) for _ in range(12)],
        "huge pages (io_memory.aligned_empty)": [aligned_empty(piece // 4).normal_() for _ in range(12)],
    }
    out: dict[str, list[float]] = {name: [] for name in pools}
    with NVMeSwapper(directory, block_size=1 << 20, io_threads=8) as s:
        s.write("file", aligned_empty(count * piece // 4).normal_())
        for _ in range(rounds):
            for name, pool in pools.items():
                start, pending = time.perf_counter(), []
                for i in range(count):
                    if len(pending) == 3:
                        pending.pop(0).wait()
                    pending.append(s.swap_in("file", pool[i % len(pool)], offset=i * piece))
                for h in pending:
                    h.wait()
                out[name].append(count * piece / (time.perf_counter() - start) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", default=tempfile.gettempdir(), help="directory on the disk to measure")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="1048576:4,1048576:8,8388608:4",
                    help="block_size:threads pairs for the swapper")
    ap.add_argument("--pages", action="store_true",
                    help="only the read bandwidth into buffers whose pages are placed three ways")
    args = ap.parse_args()
    if args.pages:
        print(f"{args.size_mb} MiB under {args.path}, read as 16 MiB pieces, 3 in flight, into 12 buffers "
              f"(1 MiB requests, 8 threads); GB/s per round")
        for name, rates in page_placement_bandwidth(args.path, args.size_mb, args.rounds).items():
            print(f"{name:42s} " + " ".join(f"{r:5.2f}" for r in rates))
        return
    raw_w, raw_r = raw_bandwidth(args.path, args.size_mb)
    print(f"{args.size_mb} MiB under {args.path}")
    print(f"{'':34s} {'write GB/s':>10s} {'read GB/s':>10s} {'% raw w':>8s} {'% raw r':>8s}")
    print(f"{'raw (dd, O_DIRECT, 1 MiB)':34s} {raw_w:10.2f} {raw_r:10.2f} {100:8.0f} {100:8.0f}")
    for cfg in args.configs.split(","):
        block, threads = (int(x) for x in cfg.split(":"))
        w, r = swapper_bandwidth(args.path, args.size_mb, block, threads, args.rounds)
        label = f"NVMeSwapper {block >> 10} KiB x {threads}"
        print(f"{label:34s} {w:10.2f} {r:10.2f} {100 * w / raw_w:8.0f} {100 * r / raw_r:8.0f}")
        w, r, both = swapper_piecewise_bandwidth(args.path, args.size_mb, 20, block, threads)
        label = f"  in 20 MiB files (both: {both:.2f})"
        print(f"{label:34s} {w:10.2f} {r:10.2f} {100 * w / raw_w:8.0f} {100 * r / raw_r:8.0f}")


if __name__ == "__main__":
    main()
