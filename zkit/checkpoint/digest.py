"""Checksums of every tensor a checkpoint stores, so damaged bytes are refused, not trained on.

Each rank's payload is walked (dicts, lists, tuples) and every tensor gets a digest under its
path in the payload (``pieces/3/master``, ``rng/torch``). Rank 0 keeps all ranks' tables in the
checkpoint's metadata; loading and ``zkit consolidate`` recompute the digest of each tensor they
read and refuse a mismatch naming the file and the tensor.

The digest is a Fletcher-style pair of wrapping 64-bit sums over the tensor's bytes read as
little 64-bit words: the plain sum and the position-weighted sum. It catches any change to a single
word, runs of damage (a block of 0xFF), flipped bytes and swapped words, and it is a vectorised
reduction: a Numba kernel where Numba is installed (:mod:`zkit.checkpoint.digest_kernel`), numpy's
sum and integer dot product otherwise, to the same value. A load verifies what it copies out of a
rank file in the copy's own pass (:class:`VerifiedCopies`), and the rest by a pass of its own. What
it adds to a load is measured by ``contrib/bench/bench_checkpoint_verify.py`` (docs/engine.md gives
the figures). It guards against damage, not against an adversary: pickled code is refused
separately, by ``weights_only`` loading.
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from zkit.checkpoint import digest_kernel
from zkit.checkpoint.digest_kernel import Kernel
from zkit.core.checkpoint_errors import CheckpointError

_CHUNK = 1 << 16  # words per weighted-sum chunk: 512 KiB, read from memory once, then from cache
_SLAB_MIN = 1 << 21  # words (16 MiB) below which a thread of its own does not pay
_KERNEL_MIN = 1 << 15  # words (256 KiB) from which the kernel pays for loading Numba (smaller: if loaded)
_NOWHERE = np.empty(0, dtype=np.uint64)  # the kernel's destination when it only sums
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


def _numpy_sums(x: np.ndarray) -> tuple[int, int]:
    """The plain and the weighted (by 1, 2, ...) wrapping sums of the words ``x``, with numpy."""
    plain = weighted = 0
    for i, (total, w) in enumerate(_chunk_sums(x.view(np.int64))):
        weighted += w + i * _CHUNK * total
        plain += total
    return plain, weighted


def _pick(words: int) -> Kernel | None:
    """The kernel for ``words`` words, or None for numpy: a small tensor does not load Numba."""
    return digest_kernel.kernel() if words >= _KERNEL_MIN else digest_kernel.loaded()


def _slab_sums(x: np.ndarray, into: np.ndarray | None) -> tuple[int, int]:
    """The two sums of the words ``x``, copying them into ``into`` in the same pass when given
    (only where there is the kernel: :meth:`Digest.update_copying` asks)."""
    sums = _pick(x.size)
    if into is not None:
        assert sums is not None, "a fused copy without the kernel"
        return sums(x, into, True)
    return _numpy_sums(x) if sums is None else sums(x, _NOWHERE, False)


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat numpy view (the fewest torch calls: a load
    makes one per tensor)."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy().reshape(-1)


class Digest:
    """The digest of a byte stream fed in consecutive parts (a tensor read chunk by chunk)."""

    def __init__(self) -> None:
        self.plain = 0
        self.weighted = 0
        self.words = 0  # 64-bit words summed so far
        self.carry = b""  # bytes of a word split between two parts

    def update(self, t: torch.Tensor) -> "Digest":
        raw = _raw(t.cpu().contiguous())
        if self.carry:
            need = 8 - len(self.carry)
            self.carry += raw[:need].tobytes()
            raw = raw[need:]
            if len(self.carry) == 8:
                self._add(np.frombuffer(self.carry, dtype=np.uint64))
                self.carry = b""
        whole = raw.size // 8 * 8
        if whole:
            self._add(raw[:whole].view(np.uint64))
        self.carry += raw[whole:].tobytes()
        return self

    def update_copying(self, src: torch.Tensor, dst: torch.Tensor) -> "Digest":
        """``dst.copy_(src)`` and :meth:`update` with ``src``, reading ``src`` once (the kernel
        writes each word as it sums it) where both are contiguous CPU tensors of one dtype and
        size and Numba is installed; otherwise torch's copy, then the digest."""
        n = src.numel()
        fused = (not self.carry and src.is_cpu and dst.is_cpu and src.dtype == dst.dtype and n == dst.numel()
                 and src.is_contiguous() and dst.is_contiguous()
                 and _pick(n * src.element_size() // 8) is not None)
        if not fused:
            dst.copy_(src)
            return self.update(src)
        raw, out = _raw(src), _raw(dst)
        whole = raw.size // 8 * 8
        if whole:
            self._add(raw[:whole].view(np.uint64), out[:whole].view(np.uint64))
        if whole < raw.size:
            out[whole:] = raw[whole:]
            self.carry = raw[whole:].tobytes()
        return self

    def _add(self, x: np.ndarray, into: np.ndarray | None = None) -> None:
        # A large tensor is summed in slabs on torch's intra-op threads (the kernel and numpy
        # release the GIL); the slabs' sums combine exactly, so the digest is the same on any
        # thread count.
        workers = min(torch.get_num_threads(), x.size // _SLAB_MIN)
        if workers > 1:
            step = -(-x.size // workers // _CHUNK) * _CHUNK
            starts = list(range(0, x.size, step))

            def slab(lo: int) -> tuple[int, int]:
                return _slab_sums(x[lo : lo + step], None if into is None else into[lo : lo + step])

            with ThreadPoolExecutor(workers) as pool:
                parts = list(pool.map(slab, starts))
        else:
            starts, parts = [0], [_slab_sums(x, into)]
        for lo, (total, weighted) in zip(starts, parts):
            # sum((offset + w) * x) = sum(w * x) + offset * sum(x), all modulo 2**64
            self.weighted += weighted + (self.words + lo) * total
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


def verify_payload(payload: Any, digests: dict[str, str], file: Path, done: frozenset[str] | set[str] = frozenset()) -> None:
    """Refuse ``payload`` (read from ``file``) unless every tensor, but those in ``done`` (verified
    already), matches its saved digest."""
    found = 0
    for path, t in tensors_in(payload):
        if path not in done:
            verify_tensor(t, path, digests, file)
        found += 1
    if found != len(digests):
        raise CheckpointError(f"{file}: holds {found} tensors but the checkpoint's metadata lists {len(digests)}")


class VerifiedCopies:
    """The rank files a load reads, each tensor verified as a load copies it out whole (in the
    copy's own pass, :meth:`Digest.update_copying`), the rest at :meth:`finish`. A file's tensors
    are known by object: the payloads, kept here until :meth:`finish`, keep them alive."""

    def __init__(self) -> None:
        self._files: list[tuple[Any, dict[str, str], Path, set[str]]] = []
        self._path_of: dict[int, tuple[int, str]] = {}

    def add(self, payload: Any, digests: dict[str, str], file: Path) -> None:
        """A rank file just read (mapped, not yet verified) and its saved digests."""
        for path, t in tensors_in(payload):
            self._path_of[id(t)] = (len(self._files), path)
        self._files.append((payload, digests, file, set()))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``; a whole tensor of a file added is verified in the same pass."""
        where = self._path_of.get(id(src))
        if where is None or where[1] in self._files[where[0]][3]:
            dst.copy_(src)  # a slice (verified at finish), or verified already
            return
        _, digests, file, done = self._files[where[0]]
        verify_tensor(Digest().update_copying(src, dst), where[1], digests, file)
        done.add(where[1])

    def finish(self) -> None:
        """Verify every tensor of every file added that no copy verified."""
        for payload, digests, file, done in self._files:
            verify_payload(payload, digests, file, done)
