"""Opt-in: host memory that training frees goes back to the operating system.

glibc's ``malloc`` serves a large block with ``mmap`` (returned to the system on ``free``) only
above a threshold that it raises, up to 32 MiB, each time such a block is freed. After the first
freed tensor, every tensor up to that size comes from the heap instead, and heap memory freed in
the middle stays in the process. A sharded run allocates and frees such tensors all the time
(building under ``zkit.zero.Init``, gathered units, buckets, optimizer state created at the first
step), so its resident set grows past its live tensors.

Fixing the threshold at 1 MiB returns that memory, at a price: every large tensor is then mapped
afresh and its pages faulted in when first written. Measured (docs/memory.md): at 4 ranks under
2 GiB each, ZeRO-3 trained 286M parameters with the threshold fixed against 210M with glibc's
moving threshold (``zkit estimate`` predicts 311M), and a 2-rank stage-3 step took 19% longer
(3.16 against 2.66 s, ``contrib/bench/bench_host_malloc.py``). So it is a choice, not a default: ``ZKIT_HOST_MALLOC=return`` makes
:func:`return_freed_memory` (called by ``zkit.initialize`` and ``zkit.zero.Init``) fix the
threshold once per process. A ``MALLOC_MMAP_THRESHOLD_`` of the user's own is left as it is, and
so is a C library other than glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("zkit")

#: blocks from this size up are mapped and unmapped by themselves
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_applied: bool | None = None


def return_freed_memory() -> bool:
    """With ``ZKIT_HOST_MALLOC=return``, fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES`
    (once per process); whether it is fixed."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    choice = os.environ.get("ZKIT_HOST_MALLOC", "default")
    if choice not in ("default", "return"):
        raise ValueError(f"ZKIT_HOST_MALLOC={choice!r}: expected 'return' (give freed host memory back) or 'default'")
    if choice == "default" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    log.info("host memory: glibc's mmap threshold fixed at %d bytes (ZKIT_HOST_MALLOC=return)", MMAP_THRESHOLD_BYTES)
    return True
