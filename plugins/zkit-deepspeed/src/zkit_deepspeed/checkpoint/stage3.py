"""ZeRO stage 3: every parameter cut into equal slices, one per rank.

DeepSpeed gives each parameter of ``numel`` elements a slice of ``ceil(numel / W)`` on every one
of the ``W`` ranks (the last slices padded); rank ``r`` holds elements ``[r * s, (r + 1) * s)`` of
it. A rank's file concatenates its slices of all parameters, in ``param_shapes`` order, into
``fp32_flat_groups`` (one tensor per sub-group, a parameter never split between two) with the
optimizer state of each sub-group alongside, padding included."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from zkit.core.checkpoint_errors import CheckpointError
from zkit_deepspeed.checkpoint.stage12 import slice_state


@attrs.frozen
class Slices:
    """Every parameter's slice size and where it sits in a rank's concatenated flat groups."""

    #: ``(name, numel, slice, offset)`` in flattening order
    params: tuple[tuple[str, int, int, int], ...]
    world_size: int

    @classmethod
    def of(cls, param_shapes: list[dict[str, Any]], world_size: int) -> "Slices":
        params, offset = [], 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                size = math.ceil(numel / world_size)
                params.append((name, numel, size, offset))
                offset += size
        return cls(params=tuple(params), world_size=world_size)

    @property
    def per_rank(self) -> int:
        return sum(size for _, _, size, _ in self.params)

    def ranges(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, start, end, offset)`` of the elements rank ``rank`` holds (``offset``: where
        they sit in its concatenated flat groups)."""
        out = []
        for name, numel, size, offset in self.params:
            start, end = min(rank * size, numel), min((rank + 1) * size, numel)
            if start < end:
                out.append((name, start, end, offset))
        return out


def index(slices: Slices) -> list[list[tuple[str, int, int]]]:
    return [[(n, s, e) for n, s, e, _ in slices.ranges(rank)] for rank in range(slices.world_size)]


def pieces(slices: Slices, rank: int, optim: dict[str, Any], with_state: bool, path: Path) -> list[dict[str, Any]]:
    """Rank ``rank``'s saved pieces, as zkit's rank files hold them (views, no copies)."""
    flats = [t.reshape(-1) for t in optim["fp32_flat_groups"]]
    if sum(t.numel() for t in flats) != slices.per_rank:
        raise CheckpointError(
            f"{path}: fp32_flat_groups hold {sum(t.numel() for t in flats)} elements, the parameters' slices "
            f"{slices.per_rank} (is the file from another save?)"
        )
    states: list[dict[str, Any]] = [{}] * len(flats)
    if with_state:
        base = optim.get("optimizer_state_dict", {}).get("state", {})
        states = [base.get(i, {}) for i in range(len(flats))]
    bounds = [0]
    for t in flats:
        bounds.append(bounds[-1] + t.numel())
    out = []
    for name, start, end, offset in slices.ranges(rank):
        g = next(i for i in range(len(flats)) if bounds[i] <= offset < bounds[i + 1])
        local = offset - bounds[g]
        if local + end - start > flats[g].numel():
            raise CheckpointError(f"{path}: {name}[{start}:{end}] crosses the end of sub-group {g}")
        out.append({
            "name": name, "start": start, "end": end,
            "master": flats[g][local:local + end - start].detach(),
            "state": slice_state(states[g], local, end - start),
        })
    return out
