"""Cutting a list of layers into contiguous parts, one per virtual stage, balancing a weight."""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np


def layer_weights(method: str, param_counts: Sequence[int], type_names: Sequence[str]) -> np.ndarray:
    """Per-layer weight for ``partition_method``: ``"uniform"`` (1 each), ``"parameters"``
    (trainable parameter count) or ``"type:REGEX"`` (1 for layers whose class name matches)."""
    if method == "uniform":
        return np.ones(len(param_counts))
    if method == "parameters":
        return np.asarray(param_counts, dtype=float)
    if method.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        w = np.array([1.0 if pattern.search(n) else 0.0 for n in type_names])
        if not w.any():
            raise ValueError(f"partition_method {method!r} matches no layer; layer types: {sorted(set(type_names))}")
        return w
    raise ValueError(
        f"unknown partition_method {method!r}; use 'parameters', 'uniform' or 'type:REGEX'"
    )


def balanced_bounds(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries ``b`` (``parts + 1`` of them, ``b[0] = 0``, ``b[-1] = n``) of contiguous non-empty
    parts whose largest weight is as small as possible (binary search on the bound, greedy fill)."""
    w = np.asarray(weights, dtype=float)
    n = len(w)
    if parts > n:
        raise ValueError(f"{n} layers cannot be split into {parts} parts; every part needs a layer")
    prefix = np.concatenate([[0.0], np.cumsum(w)])

    def fill(limit: float) -> list[int] | None:
        bounds = [0]
        for k in range(parts - 1):
            start = bounds[-1]
            # furthest end keeping the part under the limit and leaving a layer for each later part
            end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            end = min(max(end, start + 1), n - (parts - 1 - k))
            bounds.append(end)
        bounds.append(n)
        sums = np.diff(prefix[bounds])
        return bounds if sums.max() <= limit + 1e-9 else None

    lo, hi = float(w.max(initial=0.0)), float(prefix[-1])
    best = fill(hi) or [round(i * n / parts) for i in range(parts + 1)]
    for _ in range(60):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        found = fill(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    return best
