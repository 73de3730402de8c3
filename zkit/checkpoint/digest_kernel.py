"""The checkpoint digest's two sums as a Numba kernel, alone or inside the copy a load makes anyway.

Over 64-bit words ``x[0..n)`` the kernel returns the wrapping sums ``sum x[i]`` and
``sum (i + 1) x[i]`` (the digest of :mod:`zkit.checkpoint.digest`). It keeps four lanes of running
sums (``a += x; b += a`` per lane, additions only, so the loop vectorises), from which the weighted
sum follows: lane ``l`` holds the words ``4j + l``, and ``sum_j j x[4j + l] = m a_l - b_l`` after
``m`` rounds. With ``copy`` it also writes every word to ``dst`` as it reads it: a load's copy out of
the mapped file and its verification become one pass, which costs what the copy costs.

Numba is optional: zkit-offload and zkit-sparse install it. :func:`kernel` compiles on first use
(cached on disk where Numba can write its cache) and returns ``None`` without Numba; the digest
then sums with numpy, to the same value.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

#: ``sums(src, dst, copy) -> (plain, weighted)`` over uint64 arrays (``dst`` is written only with ``copy``).
Kernel = Callable[[np.ndarray, np.ndarray, bool], tuple[int, int]]


def _sums(src, dst, copy):  # pragma: no cover - compiled by Numba; the tests compare it with numpy
    one = np.uint64(1)
    a0 = a1 = a2 = a3 = np.uint64(0)
    b0 = b1 = b2 = b3 = np.uint64(0)
    rounds = src.size // 4
    for j in range(rounds):
        i = 4 * j
        x0, x1, x2, x3 = src[i], src[i + 1], src[i + 2], src[i + 3]
        if copy:
            dst[i], dst[i + 1], dst[i + 2], dst[i + 3] = x0, x1, x2, x3
        a0 += x0
        a1 += x1
        a2 += x2
        a3 += x3
        b0 += a0
        b1 += a1
        b2 += a2
        b3 += a3
    plain = a0 + a1 + a2 + a3
    m = np.uint64(rounds)
    weighted = np.uint64(4) * (m * plain - (b0 + b1 + b2 + b3)) + a0 + np.uint64(2) * a1 + np.uint64(3) * a2 + np.uint64(4) * a3
    for i in range(4 * rounds, src.size):
        x = src[i]
        if copy:
            dst[i] = x
        plain += x
        weighted += (np.uint64(i) + one) * x
    return plain, weighted


@functools.cache
def kernel() -> Kernel | None:
    """The compiled kernel, or ``None`` when Numba is not installed."""
    global _loaded
    try:
        import numba
    except ImportError:
        return None
    try:
        compiled = numba.njit(cache=True, nogil=True, boundscheck=False)(_sums)
    except RuntimeError:  # no writable cache directory: compile in each process
        compiled = numba.njit(nogil=True, boundscheck=False)(_sums)

    def sums(src: np.ndarray, dst: np.ndarray, copy: bool) -> tuple[int, int]:
        plain, weighted = compiled(src, dst, copy)
        return int(plain), int(weighted)

    _loaded = sums
    return sums


_loaded: Kernel | None = None


def loaded() -> Kernel | None:
    """The kernel if an earlier :func:`kernel` call has loaded it (small tensors use it then, and
    never make a process import Numba by themselves)."""
    return _loaded
