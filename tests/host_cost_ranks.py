"""Rank function for the host-cost tests (module level: ranks are separate processes)."""
from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "contrib", "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def count_contestants(names: list[str], dtype: str, layers: int) -> dict:
    """One steady-state step of each of ``bench_host.py``'s torch-side contestants, one after
    another on this rank: its counts (``by_op`` left out)."""
    import bench_host

    out = {}
    for name in names:
        r = bench_host.torch_side_rank(name, dtype, bench_host.shape_json(layers), 2, 2, 1)
        out[name] = {k: v for k, v in r.items() if k not in ("by_op", "host_ms")}
    return out
