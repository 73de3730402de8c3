"""Host memory that training frees goes back to the operating system when memory is tight.

glibc's ``malloc`` serves a large block with ``mmap`` (returned to the system on ``free``) only
above a threshold that it raises, up to 32 MiB, each time such a block is freed. After the first
freed tensor, every tensor up to that size comes from the heap instead, and heap memory freed in
the middle stays in the process. A sharded run allocates and frees such tensors all the time
(building under ``zkit.zero.Init``, gathered units, buckets, gradients, optimizer state created at
the first step), so its resident set grows past its live tensors: measured at 4 ranks under 2 GiB
each, ZeRO-3 trained 210M parameters where its live tensors allowed 286M.

Fixing the threshold at 1 MiB returns that memory, at a price: every large tensor is then mapped
afresh and its pages faulted in when first written (a 2-rank stage-3 step took 19-24% longer,
``contrib/bench/bench_host_malloc.py``; 11-17% since stage 3 reuses its gathered buffers).
Returning freed pages at every step with ``malloc_trim`` costs about half as much and saves
little (the resident set peaks inside the step). So zkit pays the price only where the memory
matters, chosen by ``ZKIT_HOST_MALLOC``:

* ``auto`` (the default): :func:`fit_to_memory`, called once an engine is built, fixes the
  threshold when the rank's model states in host memory take at least :data:`TIGHT_FRACTION` of
  the memory the rank may use (:func:`rank_memory_limit`: the cgroup's limit or the machine's
  memory, shared by the ranks on the node). One-off heap trims (:func:`trim`) after
  ``zkit.zero.Init`` and ``zkit.initialize`` give back what building and partitioning freed.
* ``return``: fix the threshold always (:func:`return_freed_memory`, before an engine or
  ``zkit.zero.Init`` builds anything).
* ``keep``: leave glibc alone.

The built-in plugin ``zkit.host_memory`` (:mod:`zkit.host_memory.plugin`) applies this policy
through the engine's hooks; blocking it (``ZKIT_BLOCK_PLUGINS=zkit.host_memory``) leaves glibc
alone whatever ``ZKIT_HOST_MALLOC`` says, except where an offload asks (below).

An offload that keeps the model out of host memory (zkit-offload's NVMe allocator) asks for the
threshold with :func:`return_freed_memory` ``(because=...)`` whatever the model's size, unless
``keep``: host memory is then the limit, and a page fault per reused block is cheap next to the
disk traffic (a 210M-parameter GPT built into NVMe stayed at 1.1 GB resident instead of 0.4 GB
with glibc's default). It also trims after freeing in bulk.

A ``MALLOC_MMAP_THRESHOLD_`` of the user's own is left as it is, and so is a C library other than
glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("zkit")

#: blocks from this size up are mapped and unmapped by themselves
MMAP_THRESHOLD_BYTES = 1 << 20
#: ``auto`` returns freed memory once the model states take this share of the rank's memory: by
#: then the heap that glibc keeps (up to the step's transient buffers again) no longer fits beside
#: them (measured: the default failed from 0.42 of 2 GiB per rank at ZeRO-3, 4 ranks)
TIGHT_FRACTION = 1 / 3
CHOICES = ("auto", "return", "keep")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_applied = False


def choice() -> str:
    """``ZKIT_HOST_MALLOC``, checked."""
    value = os.environ.get("ZKIT_HOST_MALLOC", "auto")
    if value not in CHOICES:
        raise ValueError(
            f"ZKIT_HOST_MALLOC={value!r}: expected 'auto' (give freed host memory back when memory is tight, "
            "the default), 'return' (always) or 'keep' (never)"
        )
    return value


def return_freed_memory(because: str | None = None) -> bool:
    """With ``ZKIT_HOST_MALLOC=return``, or ``because`` (what needs it) under anything but
    ``keep``, fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (once per process);
    whether it is fixed."""
    wanted = choice() == "return" or (because is not None and choice() != "keep")
    if not wanted or _applied:
        return _applied
    if _fix_threshold():
        log.info("host memory: glibc's mmap threshold fixed at %d bytes (%s)", MMAP_THRESHOLD_BYTES,
                 because or "ZKIT_HOST_MALLOC=return")
    return _applied


def fit_to_memory(state_bytes: int, local_ranks: int = 1) -> bool:
    """Under ``auto``: fix the threshold when ``state_bytes`` (this rank's model states in host
    memory) reach :data:`TIGHT_FRACTION` of :func:`rank_memory_limit`; whether it is fixed."""
    if choice() != "auto":
        return return_freed_memory()
    limit = rank_memory_limit(local_ranks)
    if _applied or limit is None or state_bytes < TIGHT_FRACTION * limit:
        return _applied
    if _fix_threshold():
        log.info(
            "host memory: model states take %.2f GiB of the %.2f GiB this rank may use, so freed host memory "
            "goes back to the system (glibc's mmap threshold fixed at %d bytes; ZKIT_HOST_MALLOC=keep to leave it)",
            state_bytes / 2**30, limit / 2**30, MMAP_THRESHOLD_BYTES,
        )
    return _applied


def trim() -> bool:
    """Give free heap pages back to the system now (``malloc_trim``), except under ``keep``;
    whether anything was released. For one-off points after a burst of frees, not every step."""
    if choice() == "keep":
        return False
    fn = _libc_function("malloc_trim", [ctypes.c_size_t])
    return bool(fn(0)) if fn is not None else False


def rank_memory_limit(local_ranks: int = 1, root: Path = Path("/")) -> int | None:
    """Bytes of memory one of ``local_ranks`` ranks on this machine may use: the tightest of the
    cgroup limits above this process and the machine's memory, shared evenly; ``None`` when
    neither can be read."""
    limits = [n for n in (_cgroup_limit(root), _mem_total(root)) if n is not None]
    return min(limits) // max(1, local_ranks) if limits else None


def _cgroup_limit(root: Path) -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            base, name = root / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        group = base / path.lstrip("/")
        while True:  # the limit that binds may be any ancestor's
            try:
                text = (group / name).read_text().strip()
                if text != "max" and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
                    found.append(int(text))
            except (OSError, ValueError):
                pass
            if group == base or base not in group.parents:
                break
            group = group.parent
    return min(found) if found else None


def _mem_total(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fix_threshold() -> bool:
    global _applied
    if _applied or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _applied
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    _applied = True
    return True


@functools.cache
def _libc() -> ctypes.CDLL | None:
    found = ctypes.util.find_library("c")  # runs the loader-cache query: once per process
    try:
        return ctypes.CDLL(found) if found is not None else None
    except OSError:
        return None


def _libc_function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    libc = _libc()
    try:
        fn = getattr(libc, name) if libc is not None else None
    except AttributeError:  # not glibc (musl, macOS)
        return None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
