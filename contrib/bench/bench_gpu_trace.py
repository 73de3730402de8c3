"""Where a step's time goes: a ``torch.profiler`` trace of one step, summarised.

The trace (Chrome format, open it in Perfetto or ``chrome://tracing``) is written as it is. The
summary: the share of the step's wall time the device spent in kernels (the union of their
intervals: what the gaps between kernels leave), the largest gap between two kernels, and per kind
of zkit range (``zkit.core.profiling``: ``gather``, ``release``, ``reduce``, ``forward`` ...) how many
there were and their host time in all, which is the host time of ZeRO-3's module hooks.

Read back from the file (``summarise``, or from the command line, one column per trace)::

    python contrib/bench/bench_gpu_trace.py results/gpu/zero/trace_*.json

the step's span, the device's busy time and its idle gaps (the largest ones: in which phase, which
host op launched the kernel that ended them, which host op ran longest in them), copies by kind
and stream and how much of them overlapped kernels, synchronisations, kernel launches, the host
ops with the most self time, and zkit's ranges."""
from __future__ import annotations

import bisect
import json
import os
import sys
import time
from collections import defaultdict
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


# -- a trace read back from its file ------------------------------------------------------------------
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint intervals covered by ``spans`` (start, end), in order."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap(spans: list[tuple[float, float]], covered: list[tuple[float, float]]) -> float:
    """Time of ``spans`` that lies inside the disjoint, sorted intervals ``covered``."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in covered)


def self_times(host: list[dict[str, Any]]) -> None:
    """Sets ``e["self"]`` (duration less that of the events nested in it, per thread) and
    ``e["parent"]`` on every host event."""
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    for events in by_tid.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for e in events:
            e["self"], e["parent"] = e["dur"], None
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                e["parent"] = stack[-1]
                stack[-1]["self"] -= e["dur"]
            stack.append(e)


def op_of(e: dict[str, Any] | None) -> str:
    """The innermost host op (not a runtime call) that encloses ``e``."""
    while e is not None and e["cat"] in ("cuda_runtime", "cuda_driver"):
        e = e["parent"]
    return "-" if e is None else e["name"][:60]


def summarise(path: str, top: int = 5) -> dict[str, Any]:
    """The figures of one trace (times in ms); see the module's docstring."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    self_times(host)
    launch = {e["args"]["correlation"]: e for e in host
              if e["cat"] in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    start = min(e["ts"] for e in host if e["cat"] == "cpu_op")
    end = max(e["ts"] + e["dur"] for e in device + host)

    def first(*names: str) -> float:
        return min((e["ts"] for e in host if e["name"].startswith(names)), default=end)

    backward = first("zkit backward", "autograd::engine::evaluate_function")
    step = first("zkit optimizer.step", "Optimizer.step#")

    def phase(ts: float) -> str:
        return "step" if ts >= step else "backward" if ts >= backward else "forward"

    kernels = [e for e in device if e["cat"] == "kernel"]
    busy_spans = union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    kernel_spans = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    device.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in device]
    gaps = []
    for (_, a), (b, _) in zip(busy_spans, busy_spans[1:]):
        by = launch.get(device[bisect.bisect_left(starts, b)]["args"].get("correlation"))
        gaps.append({"ms": (b - a) / 1e3, "phase": phase(by["ts"] if by else b), "launched_by": op_of(by),
                     "span": (a, b)})
    gaps.sort(key=lambda g: -g["ms"])
    for g in gaps[:top]:  # the host op with the most self time inside the gap (approximately)
        a, b = g.pop("span")
        inside = [e for e in host if e["ts"] < b and e["ts"] + e["dur"] > a]
        longest = max(inside, key=lambda e: min(b, e["ts"] + e["self"]) - max(a, e["ts"]), default=None)
        g["host_in_gap"] = "-" if longest is None else longest["name"][:60]
    phases: dict[str, float] = defaultdict(float)
    for g in gaps:
        phases[g["phase"]] += g["ms"]
    copies: dict[str, list[float]] = {}
    for e in device:
        if e["cat"] == "gpu_memcpy":
            key = f"{e['name'].split(' (')[0].removeprefix('Memcpy ')} s{e['args'].get('stream')}"
            c = copies.setdefault(key, [0, 0.0, 0.0])
            c[0] += 1
            c[1] += e["dur"] / 1e3
            c[2] += overlap([(e["ts"], e["ts"] + e["dur"])], kernel_spans) / 1e3
    syncs: dict[str, list[Any]] = {}
    for e in host:
        if e["name"] in SYNCS or e["name"] == "aten::item":
            s = syncs.setdefault(e["name"], [0, 0.0, set()])
            s[0] += 1
            s[1] += e["dur"] / 1e3
            s[2].add(f"{op_of(e['parent'])}@{phase(e['ts'])}")
    by_name: dict[str, float] = defaultdict(float)
    for e in host:
        if not e["name"].startswith("zkit "):
            by_name[e["name"][:60]] += e["self"] / 1e3
    ranges: dict[str, list[float]] = {}
    for e in host:
        if e["name"].startswith(PREFIX):
            r = ranges.setdefault(e["name"][len(PREFIX):].split(" ")[0], [0, 0.0])
            r[0] += 1
            r[1] += e["dur"] / 1e3
    return {
        "name": os.path.basename(path).removeprefix("trace_").removesuffix(".json"),
        "wall_ms": (end - start) / 1e3,
        "phases_ms": {"forward": (backward - start) / 1e3, "backward": (step - backward) / 1e3,
                      "step": (end - step) / 1e3},
        "busy_ms": sum(b - a for a, b in busy_spans) / 1e3,
        "kernel_ms": sum(b - a for a, b in kernel_spans) / 1e3,
        "idle_ms": sum(g["ms"] for g in gaps), "gaps": len(gaps), "idle_by_phase_ms": dict(phases),
        "largest_gaps": gaps[:top], "copies": copies,
        "syncs": {k: [v[0], v[1], sorted(v[2])] for k, v in syncs.items()},
        "kernels": len(kernels), "launches": sum(1 for e in host if "LaunchKernel" in e["name"]),
        "top_host_ops": sorted(by_name.items(), key=lambda kv: -kv[1])[:top], "ranges": ranges,
    }


def main(paths: list[str]) -> int:
    for path in paths:
        s = summarise(path)
        print(f"## {s['name']}: step {s['wall_ms']:.1f} ms on the host's clock "
              f"(forward {s['phases_ms']['forward']:.1f}, backward {s['phases_ms']['backward']:.1f}, "
              f"step {s['phases_ms']['step']:.1f}); device busy {s['busy_ms']:.1f} ms (kernels {s['kernel_ms']:.1f}); "
              f"idle {s['idle_ms']:.1f} ms in {s['gaps']} gaps "
              + ", ".join(f"{k} {v:.1f}" for k, v in s["idle_by_phase_ms"].items())
              + f"; {s['kernels']} kernels, {s['launches']} launch calls")
        for g in s["largest_gaps"]:
            print(f"  gap {g['ms']:.2f} ms in {g['phase']}: before {g['launched_by']}; host busy in {g['host_in_gap']}")
        for k, (n, ms, over) in s["copies"].items():
            print(f"  copy {k}: {n}, {ms:.2f} ms, {over:.2f} ms of it under kernels")
        for k, (n, ms, where) in s["syncs"].items():
            print(f"  sync {k}: {n}, {ms:.2f} ms host, in {'; '.join(where)[:200]}")
        print("  host self time: " + "; ".join(f"{k} {v:.1f}" for k, v in s["top_host_ops"]))
        if s["ranges"]:
            print("  zkit ranges: " + "; ".join(f"{k} {n}x {ms:.1f} ms" for k, (n, ms) in s["ranges"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
