"""Row bucketing of the PyTorch path: the cost-model partition and the bucket invariants."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_sparse.block_lut import build_lut, partition_widths


def _cost(widths, counts, starts, overhead):
    bounds = list(starts) + [len(widths)]
    return sum(widths[a] * sum(counts[a:b]) + overhead for a, b in zip(bounds, bounds[1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7, unique=True),
       st.data(), st.floats(0, 50))
def test_partition_is_optimal(widths, data, overhead):
    widths = sorted(widths, reverse=True)
    counts = data.draw(st.lists(st.integers(1, 9), min_size=len(widths), max_size=len(widths)))
    starts = partition_widths(widths, counts, overhead)
    assert starts[0] == 0 and starts == sorted(set(starts))
    brute = min(_cost(widths, counts, (0,) + cut, overhead)
                for r in range(len(widths))
                for cut in itertools.combinations(range(1, len(widths)), r))
    assert _cost(widths, counts, starts, overhead) == pytest.approx(brute)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.booleans(), st.floats(0, 20),
       st.integers(0, 2**16))
def test_buckets_cover_every_block_once(heads, nb, causal, overhead, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = torch.rand(heads, nb, nb, generator=gen) < 0.4
    block = 4
    lut = build_lut(layout, block, causal, bucket_overhead=overhead)
    want = layout & torch.ones(nb, nb, dtype=torch.bool).tril() if causal else layout
    if heads > 1 and bool((layout == layout[:1]).all()):
        want = want[:1]
    assert torch.equal(lut.layout, want)
    seen = torch.zeros_like(lut.layout)
    rows_seen = []
    for b in lut.buckets:
        rows_seen += b.rows.tolist()
        for r, cols, valid in zip(b.rows.tolist(), b.col_block, b.valid):
            h, i = divmod(r, nb)
            present = cols[valid]
            assert torch.equal(present, present.sort().values)  # increasing, pads after
            assert bool(valid[: int(valid.sum())].all())
            assert not seen[h, i, present].any()
            seen[h, i, present] = True
        if b.causal_tail:
            assert bool(b.valid.all()) and torch.equal(b.col_block[:, -1], b.row_block)
        elif b.tile_mask is not None:  # masked exactly at pad slots and future keys
            n, width = b.cols.shape
            m = b.tile_mask.view(n, block, width, block)
            assert torch.equal(m.all(1).all(-1), ~b.valid)
    assert torch.equal(seen, lut.layout)
    assert sorted(rows_seen + lut.empty_rows.tolist()) == list(range(lut.layout.numel() // nb))
    if overhead == 0:
        assert lut.padded_nnz() == lut.nnz


def test_bad_bucket_overhead_and_layout():
    with pytest.raises(ValueError, match="bucket_overhead must be >= 0, got -1"):
        build_lut(torch.ones(1, 2, 2), 4, False, bucket_overhead=-1)
    with pytest.raises(ValueError, match=r"a layout must be \[heads, num_blocks, num_blocks\], got \(2, 3\)"):
        build_lut(torch.ones(2, 3), 4, False)
