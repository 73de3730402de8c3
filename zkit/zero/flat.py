"""Flatten-and-partition math shared by every ZeRO stage. Pure: no tensors, no processes.

Parameters are packed, in a given order, into *units*: contiguous flat buffers of at most
``unit_numel`` elements (a parameter larger than that gets a unit of its own). A unit is padded to a
multiple of ``world_size * align`` and split into ``world_size`` equal shards; rank ``r`` owns
elements ``[r * shard, (r + 1) * shard)`` of every unit. Units are the granularity of communication
(one bucket = one unit: one all-reduce, one reduce-scatter, one all-gather), so sharding per unit
keeps every collective balanced whatever the parameter sizes.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import attrs


@attrs.frozen
class Slot:
    """Where one parameter sits inside its unit."""

    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # first element inside the unit's flat buffer


@attrs.frozen
class SlotPiece:
    """The part of one parameter that falls inside one rank's shard of a unit."""

    slot: Slot
    param_start: int  # element range inside the flattened parameter
    param_end: int
    shard_offset: int  # where the range starts inside the rank's shard

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@attrs.frozen
class Unit:
    index: int
    slots: tuple[Slot, ...]
    numel: int  # real elements
    padded: int  # numel rounded up to a multiple of world_size * align
    world_size: int

    @property
    def shard(self) -> int:
        return self.padded // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[SlotPiece]:
        """The parameter ranges inside ``rank``'s shard, in unit order."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(SlotPiece(s, a - s.offset, b - s.offset, a - lo))
        return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_units(
    params: Iterable[tuple[str, Sequence[int]]],
    unit_numel: int,
    world_size: int,
    align: int = 1,
) -> list[Unit]:
    """Pack ``(name, shape)`` pairs, in order, into units of at most ``unit_numel`` elements."""
    if unit_numel < 1:
        raise ValueError(f"unit size must be at least 1 element, got {unit_numel}")
    if world_size < 1 or align < 1:
        raise ValueError(f"world size and alignment must be >= 1, got {world_size} and {align}")
    units: list[Unit] = []
    current: list[Slot] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            padded = _round_up(max(used, 1), world_size * align)
            units.append(Unit(len(units), tuple(current), used, padded, world_size))
        current, used = [], 0

    for name, shape in params:
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        if current and used + numel > unit_numel:
            close()
        current.append(Slot(name, shape, numel, used))
        used += numel
    close()
    return units


def owned_pieces(units: Sequence[Unit], rank: int) -> list[tuple[Unit, SlotPiece]]:
    return [(u, p) for u in units for p in u.pieces(rank)]


def pack_aligned(sizes: Sequence[int], align: int, limit: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Pack items of ``sizes`` elements, in order, into groups of about ``limit`` elements, each
    item starting on a multiple of ``align`` (a new group starts where the next item would take a
    non-empty group past ``limit``; an item larger than ``limit`` is a group of its own). Returns
    ``(group, offset)`` per item and the padded size of each group. An allocator that swaps the
    fp32 master in sub-groups (zkit-offload) lays out units this way, and the estimator with it."""
    if align < 1 or limit < 1:
        raise ValueError(f"pack_aligned: align and limit must be positive, got {align} and {limit}")
    where: list[tuple[int, int]] = []
    groups: list[int] = []
    for n in sizes:
        padded = -(-int(n) // align) * align
        if not groups or (groups[-1] > 0 and groups[-1] + padded > limit):
            groups.append(0)
        where.append((len(groups) - 1, groups[-1]))
        groups[-1] += padded
    return where, groups


def persistent_units(numels: Sequence[int], param_threshold: int, model_threshold: int) -> list[bool]:
    """Which stage-3 units stay gathered between uses (DeepSpeed's persistence rules): a unit of at
    most ``param_threshold`` elements (``stage3_param_persistence_threshold``), in unit order, as
    long as the persistent elements so far stay within ``model_threshold``
    (``stage3_model_persistence_threshold``)."""
    out, kept = [], 0
    for numel in numels:
        keep = numel <= param_threshold and kept + numel <= model_threshold
        kept += numel if keep else 0
        out.append(keep)
    return out
