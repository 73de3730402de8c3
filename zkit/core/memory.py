"""What this process holds in memory: resident set, CUDA allocator, zkit's allocator by purpose."""
from __future__ import annotations

import resource
import sys
from typing import Mapping

import torch


def _proc_status_bytes() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) from /proc/self/status, in bytes; {} where there is no /proc."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    amount, unit = rest.split()  # e.g. "524288 kB"
                    found[key] = int(amount) * (1024 if unit == "kB" else 1)
    except OSError:
        pass
    return found


def memory_snapshot(allocator_stats: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, int]:
    """A flat dict of byte counts for this process.

    * ``rss_bytes``, ``peak_rss_bytes``: resident memory now and at its peak (Linux
      ``/proc/self/status``; elsewhere the peak from ``getrusage`` stands in for both).
    * ``cuda_allocated_bytes``, ``cuda_reserved_bytes``, ``cuda_peak_allocated_bytes``: the CUDA
      caching allocator on the current device, when CUDA has been initialised.
    * ``<purpose>_bytes`` and ``<purpose>_peak_bytes``: from ``allocator_stats``, the
      ``{purpose: {"live": bytes, "peak": bytes}}`` of :meth:`zkit.core.allocator.Allocator.stats`.
    """
    snap: dict[str, int] = {}
    status = _proc_status_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
    snap["rss_bytes"] = status.get("VmRSS", peak_bytes)
    snap["peak_rss_bytes"] = status.get("VmHWM", peak_bytes)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        snap["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        snap["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    for purpose, counts in (allocator_stats or {}).items():
        snap[f"{purpose}_bytes"] = int(counts["live"])
        snap[f"{purpose}_peak_bytes"] = int(counts["peak"])
    return snap
