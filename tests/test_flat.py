"""Properties of the flatten/partition math every stage relies on."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.zero.flat import owned_pieces, pack_aligned, plan_units

shapes = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3), min_size=1, max_size=12)


def _params(shape_list):
    return [(f"p{i}", tuple(s)) for i, s in enumerate(shape_list)]


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 64), st.integers(1, 5), st.integers(1, 4))
def test_units_cover_every_parameter_exactly_once(shape_list, unit_numel, world, align):
    params = _params(shape_list)
    units = plan_units(params, unit_numel, world, align)
    seen = [s.name for u in units for s in u.slots]
    assert seen == [n for n, _ in params]  # order kept, each parameter once
    for u in units:
        assert u.padded % (world * align) == 0 and u.padded >= u.numel
        end = 0
        for s in u.slots:
            assert s.offset == end and s.numel == math.prod(s.shape)
            end += s.numel
        assert end == u.numel
        # a unit exceeds the limit only when it holds one oversized parameter
        assert u.numel <= unit_numel or len(u.slots) == 1


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 64), st.integers(1, 5))
def test_shards_partition_every_element_without_overlap(shape_list, unit_numel, world):
    params = _params(shape_list)
    units = plan_units(params, unit_numel, world)
    covered = {name: [] for name, _ in params}
    for rank in range(world):
        for unit, piece in owned_pieces(units, rank):
            lo, hi = unit.shard_range(rank)
            # the piece sits inside the rank's shard, at the offset the unit says
            assert 0 <= piece.shard_offset and piece.shard_offset + piece.numel <= hi - lo
            assert lo + piece.shard_offset == piece.slot.offset + piece.param_start
            covered[piece.slot.name].append((piece.param_start, piece.param_end))
    for name, shape in params:
        ranges = sorted(covered[name])
        pos = 0
        for a, b in ranges:
            assert a == pos and b > a
            pos = b
        assert pos == math.prod(shape)


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(1, 64), st.integers(1, 5))
def test_gather_of_scatter_is_identity(shape_list, unit_numel, world):
    """Scatter a unit's flat buffer into shards by the pieces and gather it back."""
    units = plan_units(_params(shape_list), unit_numel, world)
    for u in units:
        flat = list(range(u.padded))
        shards = [flat[slice(*u.shard_range(r))] for r in range(world)]
        assert sum(shards, []) == flat
        assert all(len(s) == u.shard for s in shards)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unit size must be at least 1"):
        plan_units([("a", (2,))], 0, 1)
    with pytest.raises(ValueError, match="world size and alignment must be >= 1"):
        plan_units([("a", (2,))], 4, 0)
    unit = plan_units([("a", (2,))], 4, 2)[0]
    with pytest.raises(ValueError, match="rank 2 out of range for world size 2"):
        unit.shard_range(2)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=12), align=st.integers(1, 1024), limit=st.integers(1, 8000))
def test_pack_aligned_places_items_in_order_aligned_and_within_their_group(sizes, align, limit):
    where, groups = pack_aligned(sizes, align, limit)
    assert len(where) == len(sizes)
    ends = {}
    for n, (g, off) in zip(sizes, where):
        assert off % align == 0 and off >= ends.get(g, 0)  # aligned, after the previous item
        ends[g] = off + -(-n // align) * align
        assert ends[g] <= groups[g]
    assert [g for g, _ in where] == sorted(g for g, _ in where)  # in order
    assert all(ends.get(g) == size for g, size in enumerate(groups))  # no slack at a group's end
    for g in range(1, len(groups)):  # a new group only where the next item would overflow
        first = next(n for n, (h, _) in zip(sizes, where) if h == g)
        assert groups[g - 1] + -(-first // align) * align > limit


def test_pack_aligned_rejects_non_positive_arguments():
    with pytest.raises(ValueError, match="pack_aligned: align and limit must be positive, got 0 and 5"):
        pack_aligned([1], 0, 5)
