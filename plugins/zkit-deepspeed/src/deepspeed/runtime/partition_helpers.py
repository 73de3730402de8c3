"""DeepSpeed's small helpers from ``deepspeed.runtime.utils`` that pipeline code and DeepSpeed's tests
call: splitting items into parts, and a call's text form."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["call_to_str", "partition_balanced", "partition_uniform"]


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(repr(a), ..., k=repr(v), ...)``, as text."""
    inner = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(inner)})"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of near-equal parts (the first parts one larger); with fewer
    items than parts, one item per part and empty parts at the end."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` whose largest and smallest sums
    differ least (DeepSpeed's linear-partition dynamic programme; ties go to the later split, as
    in DeepSpeed, so both give the same boundaries). Fewer items than parts: uniform."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[i][j]: (spread, largest, smallest, split) of the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                _, high, low, _ = best[k][j - 1]
                part = prefix[i] - prefix[k]
                top, bottom = max(high, part), min(low, part)
                if best[i][j][0] >= top - bottom:
                    best[i][j] = (top - bottom, top, bottom, k)
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]
