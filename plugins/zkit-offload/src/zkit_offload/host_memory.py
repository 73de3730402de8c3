"""Give freed host memory back to the operating system (glibc's allocator).

glibc serves large allocations from ``mmap`` only until one is freed; then it raises its mmap
threshold and serves blocks of that size from the heap, where freed blocks stay in the process
(its resident size) unless they sit at the top. Offload frees many shard-sized blocks (a module's
parameters once its shard is on NVMe, gathered parameters after use), so without a trim a process
whose live data is small can keep gigabytes resident: measured here, a 210M-parameter GPT built
under ``zkit.zero.Init`` into NVMe stayed at 1.1 GB resident instead of 0.4 GB.
Two remedies, both no-ops without glibc (musl, macOS):

* :func:`serve_large_blocks_from_mmap` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``), so
  every block of 1 MiB or more is its own mapping, returned to the OS when freed. The NVMe
  allocator sets it when it is created (a model built under ``zkit.zero.Init`` with its config
  too): with the model on NVMe, host memory is the limit, and a page-fault per reused block is
  cheap next to the disk traffic. It applies to the whole process; CPU offload alone leaves the
  allocator as it is.
* :func:`trim` (``malloc_trim``) returns free heap pages below the threshold; the NVMe stores call
  it after they free memory in bulk.
"""
from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h)
_M_MMAP_THRESHOLD = -3

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    _mallopt = _libc.mallopt
    _mallopt.argtypes, _mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _malloc_trim = _mallopt = None


def serve_large_blocks_from_mmap(threshold: int = 1 << 20) -> bool:
    """Serve blocks of ``threshold`` bytes or more from their own mappings (module docstring);
    whether the allocator accepted it."""
    return bool(_mallopt(_M_MMAP_THRESHOLD, int(threshold))) if _mallopt is not None else False


def trim() -> bool:
    """Return free heap memory to the OS; whether anything was released."""
    return bool(_malloc_trim(0)) if _malloc_trim is not None else False
