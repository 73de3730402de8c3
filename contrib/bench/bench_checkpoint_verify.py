"""What verifying checkpoint checksums costs: load time with and without verification.

Saves a checkpoint of a GPT (one rank, fp32, Adam state), then times, several rounds interleaved:
reading every rank file as loading does (``torch.load(weights_only=True, mmap=True)`` and a copy of
every tensor out of the mapping) with and without the digest check (verified in the copy's pass, as
loading does), the engine's whole ``load_checkpoint`` with and without it, and the digest alone
against zlib's CRC-32 over the same bytes. Page cache hot (the file was just written) unless
``--cold``: the least favourable case for verification, whose share grows as the read gets faster;
``--cold`` evicts the files before each timed read, as after a restart. ``--no-kernel`` sums with
numpy, as where Numba is not installed. ::

    .venv/bin/python contrib/bench/bench_checkpoint_verify.py --preset medium --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

import zkit
import zkit.checkpoint.digest as digest_mod
from zkit.checkpoint.digest import VerifiedCopies, tensor_digest, tensors_in
import zkit.checkpoint.load as zkit_load
from zkit.checkpoint.files import file_digests, rank_file, read_meta
from zkit.models import GPT, GPTConfig


def timed(fn, rounds: int) -> list[tuple[float, float]]:
    """``rounds`` runs of ``fn``: each one's wall time and the CPU time of this thread (which does
    all the work at one thread, and which other processes on a shared machine do not inflate)."""
    samples = []
    for _ in range(rounds):
        start, cpu = time.perf_counter(), time.thread_time()
        fn()
        samples.append((time.perf_counter() - start, time.thread_time() - cpu))
    return samples


def summary(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Median wall time, fastest wall time, median CPU time."""
    wall = [w for w, _ in samples]
    return statistics.median(wall), min(wall), statistics.median(c for _, c in samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold", action="store_true",
                   help="evict the checkpoint's files from the page cache before each timed read (posix_fadvise)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the digest uses as many)")
    p.add_argument("--no-kernel", action="store_true", help="sum with numpy, as without Numba")
    args = p.parse_args(argv)
    if args.no_kernel:
        digest_mod._pick = lambda words: None
    torch.set_num_threads(args.threads)
    model = GPT(GPTConfig.preset(args.preset))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "steps_per_print": 1_000_000}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag="t")
        where = Path(tmp) / "t"
        path = where / rank_file(0)
        digests = file_digests(read_meta(where), rank_file(0), where)
        nbytes = path.stat().st_size

        def evict() -> None:
            if args.cold:  # as after a restart: the bytes come from the disk, not the page cache
                for f in where.iterdir():
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)

        def read(verify: bool) -> None:
            evict()
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            verified = VerifiedCopies()
            if verify:
                verified.add(data, digests, path)
            for _, t in tensors_in(data):
                verified.copy(torch.empty_like(t), t)
            verified.finish()

        def digest_only() -> None:
            for _, t in tensors_in(torch.load(path, map_location="cpu", weights_only=True, mmap=True)):
                tensor_digest(t)

        def crc_only() -> None:
            for _, t in tensors_in(torch.load(path, map_location="cpu", weights_only=True, mmap=True)):
                zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())

        read(True)  # warm the page cache
        plain, checked = [], []
        for _ in range(args.rounds):  # interleaved, so drift hits both alike
            plain += timed(lambda: read(False), 1)
            checked += timed(lambda: read(True), 1)

        def load(verify: bool) -> None:
            # Unverified: the loader reads no checksums, as for a checkpoint written without them.
            saved = zkit_load.file_digests
            zkit_load.file_digests = saved if verify else (lambda *_: None)
            evict()
            try:
                engine.load_checkpoint(tmp, tag="t")
            finally:
                zkit_load.file_digests = saved

        loads, loads_checked = [], []
        for _ in range(args.rounds):
            loads += timed(lambda: load(False), 1)
            loads_checked += timed(lambda: load(True), 1)
        digest_alone = timed(digest_only, args.rounds)
        crc_alone = timed(crc_only, args.rounds)
    gb = nbytes / 1e9
    print(f"checkpoint: {engine.partitioner.units[0].numel / 1e6:.1f}M parameters, rank file {nbytes / 2**20:.0f} MiB, "
          f"{args.threads} thread(s), page cache {'cold' if args.cold else 'hot'}, digest summed by "
          f"{'numpy' if digest_mod._pick(1 << 30) is None else 'the Numba kernel'}")
    rows = [("read rank file, no verification", plain), ("read rank file, verified", checked),
            ("engine.load_checkpoint, no verification", loads), ("engine.load_checkpoint, verified", loads_checked),
            ("zkit digest alone", digest_alone), ("zlib CRC-32 alone (for comparison)", crc_alone)]
    # Wall time: median and fastest round (on a loaded machine the least disturbed); CPU time: median.
    print(f"{'measure':42} {'wall s':>7} {'GB/s':>6} {'fastest':>7} {'CPU s':>7}")
    for name, samples in rows:
        wall, fastest, cpu = summary(samples)
        print(f"{name:42} {wall:>7.3f} {gb / wall:>6.2f} {fastest:>7.3f} {cpu:>7.3f}")

    def added(without: list, with_: list) -> str:
        a, b = summary(without), summary(with_)
        return "/".join(f"{(y - x) / x * 100:+.1f}%" for x, y in zip(a, b))

    print(f"verification adds (wall median / wall fastest / CPU median): {added(plain, checked)} to a file read, "
          f"{added(loads, loads_checked)} to engine.load_checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
