"""What verifying checkpoint checksums costs: load time with and without verification.

Saves a checkpoint of a GPT (one rank, fp32, Adam state), then times, several rounds interleaved:
reading every rank file as loading does (``torch.load(weights_only=True, mmap=True)`` and a copy of
every tensor out of the mapping) with and without the digest check, the engine's whole
``load_checkpoint`` with and without it, and the digest alone against zlib's CRC-32 over the same bytes. Page cache hot
(the file was just written) unless ``--cold``: the least favourable case for verification, whose
share grows as the read gets faster; ``--cold`` evicts the files before each timed read, as after a
restart. ::

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
from zkit.checkpoint.digest import tensor_digest, tensors_in, verify_payload
import zkit.checkpoint.load as zkit_load
from zkit.checkpoint.files import file_digests, rank_file, read_meta
from zkit.models import GPT, GPTConfig


def timed(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold", action="store_true",
                   help="evict the checkpoint's files from the page cache before each timed read (posix_fadvise)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the digest uses as many)")
    args = p.parse_args(argv)
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
            if verify:
                verify_payload(data, digests, path)
            for _, t in tensors_in(data):
                t.clone()

        def digest_only() -> None:
            for _, t in tensors_in(torch.load(path, map_location="cpu", weights_only=True, mmap=True)):
                tensor_digest(t)

        def crc_only() -> None:
            for _, t in tensors_in(torch.load(path, map_location="cpu", weights_only=True, mmap=True)):
                zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())

        read(True)  # warm the page cache
        plain, checked = [], []
        for _ in range(args.rounds):  # interleaved, so drift hits both alike
            plain.append(timed(lambda: read(False), 1))
            checked.append(timed(lambda: read(True), 1))
        t_plain, t_checked = statistics.median(plain), statistics.median(checked)
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
            loads.append(timed(lambda: load(False), 1))
            loads_checked.append(timed(lambda: load(True), 1))
        t_load0, t_load = statistics.median(loads), statistics.median(loads_checked)
        t_digest = timed(digest_only, args.rounds)
        t_crc = timed(crc_only, args.rounds)
    gb = nbytes / 1e9
    print(f"checkpoint: {engine.partitioner.units[0].numel / 1e6:.1f}M parameters, rank file {nbytes / 2**20:.0f} MiB, "
          f"{args.threads} thread(s), page cache {'cold' if args.cold else 'hot'}")
    print(f"{'measure':42} {'seconds':>8} {'GB/s':>6}")
    print(f"{'read rank file, no verification':42} {t_plain:>8.3f} {gb / t_plain:>6.2f}")
    print(f"{'read rank file, verified':42} {t_checked:>8.3f} {gb / t_checked:>6.2f}")
    print(f"{'engine.load_checkpoint, no verification':42} {t_load0:>8.3f} {gb / t_load0:>6.2f}")
    print(f"{'engine.load_checkpoint, verified':42} {t_load:>8.3f} {gb / t_load:>6.2f}")
    print(f"{'zkit digest alone':42} {t_digest:>8.3f} {gb / t_digest:>6.2f}")
    print(f"{'zlib CRC-32 alone (for comparison)':42} {t_crc:>8.3f} {gb / t_crc:>6.2f}")
    print(f"verification: +{(t_checked - t_plain) / t_plain * 100:.1f}% of a file read, "
          f"+{(t_load - t_load0) / t_load0 * 100:.1f}% of engine.load_checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
