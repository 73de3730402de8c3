"""The 3D process grid: every rank is a coordinate ``(pipe, data, tensor)``.

Ranks are laid out with the *last* axis varying fastest, so with the default order
``("pipe", "data", "tensor")`` the members of a tensor-parallel group are consecutive ranks - the
same node, the fastest links - data-parallel peers are ``tensor`` apart and pipeline neighbours
``data * tensor`` apart::

    grid = ProcessGrid(pipe=2, data=2, tensor=2)       # 8 ranks
    grid.coord(5)            # Coord(pipe=1, data=0, tensor=1)
    grid.rank(pipe=1, data=0, tensor=1)                # 5
    grid.groups("tensor")    # [[0, 1], [2, 3], [4, 5], [6, 7]]
    grid.groups("pipe", "tensor")                      # model-parallel groups: [[0, 1, 4, 5], [2, 3, 6, 7]]

:meth:`ProcessGrid.build` creates a torch.distributed group for every group of every axis (all
ranks must call it) and returns this rank's communicators, one per axis.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np
import torch.distributed as dist

from zkit.core.assembly import Assembly

AXES = ("pipe", "data", "tensor")


class GridError(ValueError):
    """A process grid that cannot be built."""


class Coord(NamedTuple):
    pipe: int
    data: int
    tensor: int


class ProcessGrid:
    """A ``pipe x data x tensor`` grid of ranks with named axes.

    ``world_size`` (default: the torch.distributed world when initialised) must equal the product
    of the degrees. ``order`` lists the axes from slowest to fastest varying.
    """

    def __init__(
        self,
        pipe: int = 1,
        data: int = 1,
        tensor: int = 1,
        *,
        world_size: int | None = None,
        order: tuple[str, ...] = AXES,
    ) -> None:
        degrees = {"pipe": pipe, "data": data, "tensor": tensor}
        for axis, degree in degrees.items():
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise GridError(f"ProcessGrid: the {axis} degree must be an int >= 1, got {degree!r}")
        if sorted(order) != sorted(AXES):
            raise GridError(f"ProcessGrid: order must be a permutation of {AXES}, got {order!r}")
        if world_size is None and dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        product = pipe * data * tensor
        if world_size is not None and product != world_size:
            raise GridError(
                f"ProcessGrid: pipe ({pipe}) x data ({data}) x tensor ({tensor}) = {product} ranks, "
                f"but the world has {world_size} ranks; choose degrees whose product is {world_size}"
            )
        self.degrees = degrees
        self.order = tuple(order)
        self.world_size = product
        # ranks[i_order0, i_order1, i_order2] = rank; the last axis of `order` varies fastest.
        self._ranks = np.arange(product).reshape([degrees[a] for a in self.order])

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={self.degrees[a]}" for a in self.order)
        return f"ProcessGrid({inner})"

    def degree(self, axis: str) -> int:
        return self.degrees[self._check_axis(axis)]

    def coord(self, rank: int) -> Coord:
        """The coordinate of ``rank``."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise GridError(f"ProcessGrid: rank must be in [0, {self.world_size}), got {rank!r}")
        index = np.unravel_index(rank, self._ranks.shape)
        by_axis = dict(zip(self.order, (int(i) for i in index)))
        return Coord(**by_axis)

    def rank(self, **coord: int) -> int:
        """The rank at a coordinate; unnamed axes default to 0."""
        for axis, value in coord.items():
            self._check_axis(axis)
            if not isinstance(value, int) or not 0 <= value < self.degrees[axis]:
                raise GridError(
                    f"ProcessGrid: {axis} coordinate must be in [0, {self.degrees[axis]}), got {value!r}"
                )
        return int(self._ranks[tuple(coord.get(a, 0) for a in self.order)])

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (each sorted, in rank order)."""
        if not axes:
            raise GridError("ProcessGrid.groups needs at least one axis")
        positions = [self.order.index(self._check_axis(a)) for a in axes]
        rest = [i for i in range(len(self.order)) if i not in positions]
        size = math.prod(self.degrees[a] for a in axes)
        moved = np.transpose(self._ranks, rest + sorted(positions)).reshape(-1, size)
        return [sorted(int(r) for r in row) for row in moved]

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group along ``axes`` that contains ``rank``."""
        self.coord(rank)
        for group in self.groups(*axes):
            if rank in group:
                return group
        raise AssertionError("unreachable: every rank is in one group per axis")  # pragma: no cover

    def build(
        self,
        rank: int | None = None,
        communicator: Callable[[Any, Any], Any] | None = None,
        config: Any = None,
    ) -> dict[str, Any]:
        """Create the process groups of every axis (collective: all ranks call it in the same
        order) and return ``{axis: communicator}`` for this rank's groups, plus ``"model"`` for
        the pipe x tensor group that holds one whole model replica.

        ``communicator(group, config)`` is a communicator record's factory (default: the
        communicator an :class:`~zkit.core.assembly.Assembly` of ``config`` gives each group)."""
        groups = self.build_groups(rank)
        if communicator is None:
            assembly = Assembly.build(config)
            return {name: assembly.communicator(group) for name, group in groups.items()}
        return {name: communicator(group, config) for name, group in groups.items()}

    def build_groups(self, rank: int | None = None) -> dict[str, Any]:
        """Create the torch.distributed groups of every axis (collective, as :meth:`build`) and
        return ``{axis: group}`` for this rank's groups, plus ``"model"`` (pipe x tensor)."""
        if rank is None:
            rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise GridError(
                f"ProcessGrid: built for {self.world_size} ranks, but the world has "
                f"{dist.get_world_size()} ranks"
            )
        mine: dict[str, Any] = {}
        for name, axes in (("pipe", ("pipe",)), ("data", ("data",)), ("tensor", ("tensor",)),
                           ("model", ("pipe", "tensor"))):
            for ranks in self.groups(*axes):
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    mine[name] = group
        return mine

    def _check_axis(self, axis: str) -> str:
        if axis not in self.degrees:
            raise GridError(f"ProcessGrid: unknown axis {axis!r}; axes: {', '.join(AXES)}")
        return axis
