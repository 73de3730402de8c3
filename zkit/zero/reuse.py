"""Which stage-3 units stay gathered until their next use (``stage3_max_reuse_distance``).

A module's parameters are released after its forward unless they are used again soon: DeepSpeed's
rule, which zkit follows, is to keep a parameter whose next use comes within
``stage3_max_reuse_distance`` parameter elements of the modules run in between (strictly fewer:
at 0 every module is released after use). The uses are the
recorded forward order followed by backward, which runs it in reverse; so the last modules of
forward are the first of backward, and a tied weight used at both ends of the model is reused
after everything else.

Keeping a unit saves its next all-gather (at the default distance, 1e9 elements, backward
gathers nothing a model of fewer elements already gathered in forward: stage 3 then moves the
bytes of stage 2); ``stage3_max_live_parameters`` still bounds what is kept.
"""
from __future__ import annotations

from typing import Sequence


def reuse_distances(trace: Sequence[int], sizes: Sequence[int], persistent: Sequence[bool]) -> list[int | None]:
    """For each position of ``trace`` (the units gathered in one forward, in order): the elements
    of the units used between that use and the unit's next use, forward then backward; ``None``
    when the unit is not used again in the step. Persistent units count nothing (never gathered)."""
    uses = list(trace) + list(trace)[::-1]
    weight = [0 if persistent[u] else sizes[u] for u in uses]
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    next_use: dict[int, int] = {}
    following: list[int | None] = [None] * len(uses)
    for j in range(len(uses) - 1, -1, -1):
        following[j] = next_use.get(uses[j])
        next_use[uses[j]] = j
    out: list[int | None] = []
    for i in range(len(trace)):
        j = following[i]
        out.append(None if j is None else prefix[j] - prefix[i + 1])
    return out


def kept_after_use(trace: Sequence[int], sizes: Sequence[int], persistent: Sequence[bool], max_reuse: int) -> list[bool]:
    """Per position of ``trace``: keep the unit gathered after that use (fewer than ``max_reuse``
    elements are used before its next use; as with DeepSpeed, 0 keeps nothing)."""
    return [d is not None and d < max_reuse for d in reuse_distances(trace, sizes, persistent)]
