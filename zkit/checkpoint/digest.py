"""Checksums of every tensor a checkpoint stores, so damaged bytes are refused, not trained on.

Each rank's payload is walked (dicts, lists, tuples) and every tensor gets a digest under its
path in the payload (``pieces/3/master``, ``rng/torch``). Rank 0 keeps all ranks' tables in the
checkpoint's metadata; loading and ``zkit consolidate`` recompute the digest of each tensor they
read and refuse a mismatch naming the file and the tensor.

The digest is a Fletcher-style pair of wrapping 64-bit sums over the tensor's bytes read as
little 64-bit words: the plain sum and the position-weighted sum. It catches any change to a single
word, runs of damage (a block of 0xFF), flipped bytes and swapped words, and it is a vectorised
reduction (numpy's sum and integer dot product), faster than CRC-32 in zlib. What it adds to a load
is measured by ``contrib/bench/bench_checkpoint_verify.py`` (docs/engine.md gives the figures). It guards against damage, not
against an adversary: pickled code is refused separately, by ``weights_only`` loading.
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from zkit.checkpoint.errors import CheckpointError

_CHUNK = 1 << 16  # words per weighted-sum chunk: 512 KiB, read from memory once, then from cache
_SLAB_MIN = 1 << 21  # words (16 MiB) below which a thread of its own does not pay
_MASK = (1 << 64) - 1
_WEIGHTS = np.arange(1, _CHUNK + 1, dtype=np.int64)


def _chunk_sums(x: np.ndarray) -> list[tuple[int, int]]:
    """The plain and the weighted (by 1, 2, ...) wrapping sums of each ``_CHUNK`` words of ``x``:
    the plain sums in one vectorised pass, each weighted sum as a dot product making no temporary
    (the chunk is read from memory once, then from cache)."""
    full = x.size - x.size % _CHUNK
    plain = [int(v) for v in x[:full].reshape(-1, _CHUNK).sum(axis=1)] if full else []
    if full < x.size:
        plain.append(int(x[full:].sum()))
    return [
        (total, int(np.dot(x[i * _CHUNK : (i + 1) * _CHUNK], _WEIGHTS[: min(_CHUNK, x.size - i * _CHUNK)])))
        for i, total in enumerate(plain)
    ]


class Digest:
    """The digest of a byte stream fed in consecutive parts (a tensor read chunk by chunk)."""

    def __init__(self) -> None:
        self.plain = 0
        self.weighted = 0
        self.words = 0  # 64-bit words summed so far
        self.carry = b""  # bytes of a word split between two parts

    def update(self, t: torch.Tensor) -> "Digest":
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if self.carry:
            need = 8 - len(self.carry)
            self.carry += bytes(raw[:need].tolist())
            raw = raw[need:]
            if len(self.carry) == 8:
                self._add(torch.frombuffer(bytearray(self.carry), dtype=torch.int64))
                self.carry = b""
        whole = raw.numel() // 8 * 8
        if whole:
            self._add(raw[:whole].view(torch.int64))
        self.carry += bytes(raw[whole:].tolist())
        return self

    def _add(self, words: torch.Tensor) -> None:
        x = words.numpy()
        # A large tensor is summed in slabs on torch's intra-op threads (numpy releases the GIL);
        # slabs are whole chunks, so the chunks and the digest are the same on any thread count.
        workers = min(torch.get_num_threads(), x.size // _SLAB_MIN)
        if workers > 1:
            step = -(-x.size // workers // _CHUNK) * _CHUNK
            with ThreadPoolExecutor(workers) as pool:
                parts = [s for slab in pool.map(_chunk_sums, [x[i : i + step] for i in range(0, x.size, step)])
                         for s in slab]
        else:
            parts = _chunk_sums(x)
        for i, (total, weighted) in enumerate(parts):
            # sum((offset + w) * x) = sum(w * x) + offset * sum(x), all modulo 2**64
            self.weighted += weighted + (self.words + i * _CHUNK) * total
            self.plain += total
        self.words += x.size

    def hexdigest(self) -> str:
        return f"{self.plain & _MASK:016x}{self.weighted & _MASK:016x}{zlib.crc32(self.carry):08x}"


def tensor_digest(t: torch.Tensor) -> str:
    """A 40-hex-digit digest of ``t``'s bytes (dtype and shape are checked by the loader)."""
    return Digest().update(t).hexdigest()


def tensors_in(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, with its path."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_in(value, f"{path}/{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_in(value, f"{path}/{i}" if path else str(i))


def payload_digests(payload: Any) -> dict[str, str]:
    """``{path: digest}`` for every tensor of a rank's payload (computed before it is written)."""
    return {path: tensor_digest(t) for path, t in tensors_in(payload)}


def verify_tensor(t: torch.Tensor | Digest, path: str, digests: dict[str, str], file: Path) -> None:
    """Refuse tensor ``path`` of ``file`` (or the digest of its bytes read in parts) unless it
    matches its saved digest."""
    expected = digests.get(path)
    if expected is None:
        raise CheckpointError(f"{file}: tensor '{path}' has no checksum in the checkpoint's metadata")
    digest = t if isinstance(t, Digest) else Digest().update(t)
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"{file}: tensor '{path}' is damaged: its checksum does not match the one saved with it "
            f"(the file changed after it was written); restore it or load another checkpoint"
        )


def verify_payload(payload: Any, digests: dict[str, str], file: Path) -> None:
    """Refuse ``payload`` (read from ``file``) unless every tensor matches its saved digest."""
    found = 0
    for path, t in tensors_in(payload):
        verify_tensor(t, path, digests, file)
        found += 1
    if found != len(digests):
        raise CheckpointError(f"{file}: holds {found} tensors but the checkpoint's metadata lists {len(digests)}")
