"""Where a step's time goes: a ``torch.profiler`` trace of one step, summarised.

The trace (Chrome format, open it in Perfetto or ``chrome://tracing``) is written as it is. The
summary: the share of the step's wall time the device spent in kernels (the union of their
intervals: what the gaps between kernels leave), the largest gap between two kernels, and per kind
of zkit range (``zkit.core.profiling``: ``gather``, ``release``, ``reduce``, ``forward`` ...) how many
there were and their host time in all, which is the host time of ZeRO-3's module hooks."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from zkit.core.profiling import PREFIX


def trace_step(step: Callable[[torch.Tensor], Any], ids: torch.Tensor, device: torch.device, path: str) -> dict[str, Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        step(ids)
        sync()
        wall = time.perf_counter() - t
    prof.export_chrome_trace(path)
    out: dict[str, Any] = {"trace": path, "traced_step_s": wall, "ranges": zkit_ranges(prof.events())}
    if device.type == "cuda":
        busy, gap = kernel_busy(prof.events())
        out.update(device_busy_s=busy, largest_gap_s=gap)
    return out


def zkit_ranges(events: Any) -> dict[str, list[float]]:
    """``{kind: [count, host seconds]}`` of the ``zkit ...`` ranges; kind is the range's first word."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.name.startswith(PREFIX) and e.device_type == torch.autograd.DeviceType.CPU:
            kind = e.name[len(PREFIX):].split(" ")[0]
            entry = out.setdefault(kind, [0, 0.0])
            entry[0] += 1
            entry[1] += (e.time_range.end - e.time_range.start) / 1e6
    return out


def kernel_busy(events: Any) -> tuple[float, float]:
    """Seconds the device ran kernels (overlapping kernels counted once) and the longest gap between them."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
                   and not e.name.startswith("Memset"))
    busy = gap = 0.0
    end = None
    for start, stop in spans:
        if end is not None and start > end:
            gap = max(gap, start - end)
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6, gap / 1e6
