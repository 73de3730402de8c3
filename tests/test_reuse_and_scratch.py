"""The pure scheduling pieces of stages 2-3: which units stay gathered for their reuse
(:mod:`zkit.zero.reuse`) and the scratch ring reductions in flight share
(:class:`zkit.zero.buckets.ScratchRing`)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from zkit.zero.buckets import ScratchRing
from zkit.zero.flat import plan_units
from zkit.zero.scratch_buckets import ScratchBuckets
from zkit.zero.reuse import kept_after_use, reuse_distances


def _brute_force(trace, sizes, persistent):
    uses = list(trace) + list(trace)[::-1]
    out = []
    for i in range(len(trace)):
        later = [j for j in range(i + 1, len(uses)) if uses[j] == uses[i]]
        out.append(None if not later else sum(0 if persistent[u] else sizes[u] for u in uses[i + 1 : later[0]]))
    return out


@given(
    trace=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    sizes=st.lists(st.integers(1, 100), min_size=6, max_size=6),
    persistent=st.lists(st.booleans(), min_size=6, max_size=6),
)
@settings(max_examples=200, deadline=None)
def test_reuse_distance_is_the_elements_used_before_the_next_use(trace, sizes, persistent):
    assert reuse_distances(trace, sizes, persistent) == _brute_force(trace, sizes, persistent)


def test_reuse_distances_of_a_chain_and_a_tied_weight():
    # embedding 0, two layers, the head reusing the embedding: forward 0 1 2 0, backward 0 2 1 0
    trace, sizes = [0, 1, 2, 0], [10, 3, 5]
    assert reuse_distances(trace, sizes, [False] * 3) == [8, 30, 20, 0]
    assert kept_after_use(trace, sizes, [False] * 3, 20) == [True, False, False, True]
    assert kept_after_use(trace, sizes, [False] * 3, 21) == [True, False, True, True]
    assert kept_after_use(trace, sizes, [False] * 3, 0) == [False] * 4  # 0: release after every use
    assert reuse_distances(trace, sizes, [False, False, True]) == [3, 20, 20, 0]  # persistent: counts nothing


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60), st.integers(40, 100), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_scratch_ring_regions_never_overlap_nor_cross_a_segment(ops, segment, count):
    ring, live = ScratchRing(segment, count), []
    for launch, numel in ops:
        if launch:
            while not ring.fits(numel):
                ring.give_back()
                live.pop(0)
            seg, start, end = ring.take(numel)
            assert 0 <= seg < count and 0 <= start < end <= segment and end - start == numel
            assert all(s != seg or end <= a or b <= start for s, a, b in live), (seg, start, end, live)
            live.append((seg, start, end))
        elif live:
            ring.give_back()
            live.pop(0)


def test_scratch_ring_holds_as_many_small_units_as_fit():
    ring = ScratchRing(10, 2)
    assert [ring.take(4) for _ in range(4)] == [(0, 0, 4), (0, 4, 8), (1, 0, 4), (1, 4, 8)]
    assert not ring.fits(3)  # 2 elements left in each segment
    ring.give_back()
    ring.give_back()
    assert ring.take(8) == (0, 0, 8)  # wraps to the segment the two oldest gave back
    assert ring.fits(2) and not ring.fits(3)  # 2 left before the oldest in flight


def test_a_unit_larger_than_a_segment_is_an_error():
    with pytest.raises(ValueError, match="a unit of 30 elements does not fit a scratch segment of 20"):
        ScratchRing(20, 2).fits(30)


class _Allocator:
    def __init__(self) -> None:
        self.live, self.made = 0, 0

    def empty(self, n, dtype, purpose):
        self.made += 1
        self.track(purpose, n * dtype.itemsize)
        return torch.full((n,), float("nan"), dtype=dtype)

    def track(self, purpose, nbytes):
        self.live += nbytes

    def release(self, t, purpose):
        self.live -= t.numel() * t.element_size()


def test_scratch_buckets_make_their_views_once_and_hold_no_memory_between_steps():
    units = plan_units([("a", (2, 3)), ("b", (5,)), ("c", (4,))], 11, 2)  # [a, b] padded to 12, [c] to 4
    alloc = _Allocator()
    buckets = ScratchBuckets(ScratchRing(12, 2), units, torch.float32, alloc, rank=1)
    seen = []
    for _ in range(2):
        first = buckets.take(0)
        first.fill([torch.ones(2, 3, dtype=torch.bfloat16), None])  # b unused in this forward: zeros
        assert torch.equal(first.flat, torch.tensor([1.0] * 6 + [0.0] * 6))
        assert first.chunk.data_ptr() == first.flat[6:].data_ptr()  # rank 1's shard
        second = buckets.take(1)
        second.fill([torch.full((4,), 2.0)])
        seen.append((first, second))
        buckets.give_back()
        buckets.give_back()
        buckets.release()
        assert alloc.live == 0 and all(s.untyped_storage().nbytes() == 0 for s in buckets.segments)
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1] and alloc.made == 2
