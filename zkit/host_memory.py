"""Host memory that training frees goes back to the operating system.

glibc's ``malloc`` serves a large block with ``mmap`` (returned to the system on ``free``) only
above a threshold that it raises, up to 32 MiB, each time such a block is freed. After the first
freed tensor, every tensor up to that size comes from the heap instead, and heap memory freed in
the middle stays in the process. A sharded run allocates and frees such tensors all the time
(building under ``zkit.zero.Init``, gathered units, buckets, optimizer state created at the first
step), so its resident set grows far past its live tensors: at 4 ranks under 2 GiB each, ZeRO-3
trained 210M parameters with the threshold left to move and 286M with it fixed at 1 MiB
(``contrib/bench/bench_zero.py --scale --scale-cap-gib 8 --scale-stages 3``, docs/benchmarks.md).

:func:`return_freed_memory` fixes the threshold once per process, as setting
``MALLOC_MMAP_THRESHOLD_`` would. It leaves glibc alone when that variable is set (the user's
choice wins) and when ``ZKIT_HOST_MALLOC=default``; elsewhere than glibc it does nothing.
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
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (once per process); whether it is fixed."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("ZKIT_HOST_MALLOC", "") == "default":
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
    log.debug("host memory: glibc's mmap threshold fixed at %d bytes", MMAP_THRESHOLD_BYTES)
    return True
