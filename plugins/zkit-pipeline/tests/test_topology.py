"""The process grid: rank <-> coordinate mapping, groups per axis, validation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_pipeline.topology import Coord, GridError, ProcessGrid

degrees = st.integers(1, 4)


@settings(max_examples=80, deadline=None)
@given(p=degrees, d=degrees, t=degrees)
def test_coord_and_rank_are_inverse_and_tensor_is_fastest(p, d, t):
    grid = ProcessGrid(pipe=p, data=d, tensor=t, world_size=p * d * t)
    for r in range(grid.world_size):
        c = grid.coord(r)
        assert grid.rank(**c._asdict()) == r
        assert r == (c.pipe * d + c.data) * t + c.tensor
    for g in grid.groups("tensor"):  # consecutive ranks
        assert g == list(range(g[0], g[0] + t))


@settings(max_examples=80, deadline=None)
@given(p=degrees, d=degrees, t=degrees, axes=st.sampled_from(
    [("pipe",), ("data",), ("tensor",), ("pipe", "tensor"), ("data", "tensor"), ("pipe", "data", "tensor")]))
def test_groups_partition_the_world_and_vary_only_their_axes(p, d, t, axes):
    grid = ProcessGrid(pipe=p, data=d, tensor=t, world_size=p * d * t)
    groups = grid.groups(*axes)
    assert sorted(r for g in groups for r in g) == list(range(grid.world_size))
    for g in groups:
        coords = [grid.coord(r) for r in g]
        for axis in {"pipe", "data", "tensor"} - set(axes):
            assert len({getattr(c, axis) for c in coords}) == 1
        assert len(g) == len({tuple(getattr(c, a) for a in axes) for c in coords})


def test_example_layout():
    grid = ProcessGrid(pipe=2, data=2, tensor=2, world_size=8)
    assert grid.coord(5) == Coord(pipe=1, data=0, tensor=1)
    assert grid.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("pipe", "tensor") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid.group_of(6, "data") == [4, 6]


def test_custom_order_puts_data_fastest():
    grid = ProcessGrid(pipe=2, data=2, tensor=1, world_size=4, order=("tensor", "pipe", "data"))
    assert grid.groups("data") == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipe=2, data=3, tensor=1, world_size=4),
         r"pipe \(2\) x data \(3\) x tensor \(1\) = 6 ranks, but the world has 4 ranks; "
         r"choose degrees whose product is 4"),
        (dict(pipe=0, world_size=1), "the pipe degree must be an int >= 1, got 0"),
        (dict(tensor=1.5), "the tensor degree must be an int >= 1, got 1.5"),
        (dict(order=("pipe", "data")), "order must be a permutation of"),
    ],
)
def test_bad_grids_are_named(kwargs, message):
    with pytest.raises(GridError, match=message):
        ProcessGrid(**kwargs)


def test_bad_coordinates_are_named():
    grid = ProcessGrid(pipe=2, data=2, world_size=4)
    with pytest.raises(GridError, match=r"rank must be in \[0, 4\), got 4"):
        grid.coord(4)
    with pytest.raises(GridError, match=r"data coordinate must be in \[0, 2\), got 2"):
        grid.rank(data=2)
    with pytest.raises(GridError, match="unknown axis 'expert'"):
        grid.groups("expert")
