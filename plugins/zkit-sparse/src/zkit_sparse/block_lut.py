"""Row buckets: the lookup table the PyTorch block-sparse path runs on.

Every (layout head, query block) row of the layout lists the key blocks it attends to. Rows are
grouped into buckets of similar length and each bucket's column lists are padded to the bucket's
longest, so one bucket is a handful of dense batched matmuls over ``[rows, block, R * block]``
score tiles. Padding per bucket is bounded (``max_padding``), so the work stays proportional to the
number of nonzero blocks even for layouts mixing short local rows with full global rows (BigBird,
Longformer). Each row belongs to exactly one bucket, so a row's softmax never spans buckets.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBucket:
    """Rows of one bucket. Indices address the ``layout_heads * num_blocks`` block axis."""

    rows: torch.Tensor  #: [n] flat index ``h * nb + i`` of each query block row
    cols: torch.Tensor  #: [n, R] flat index ``h * nb + j`` of each key block (pad slots repeat one)
    row_block: torch.Tensor  #: [n] ``i``: the query block within its head
    col_block: torch.Tensor  #: [n, R] ``j``: the key block within its head
    valid: torch.Tensor  #: [n, R] bool, False on pad slots

    @property
    def width(self) -> int:
        return self.cols.shape[1]

    def to(self, device: torch.device) -> "RowBucket":
        return RowBucket(*(t.to(device) for t in (self.rows, self.cols, self.row_block,
                                                  self.col_block, self.valid)))


@dataclass(frozen=True)
class BlockLUT:
    """The layout of one attention call, bucketed for the PyTorch path."""

    layout: torch.Tensor  #: [layout_heads, nb, nb] bool (causal: blocks above the diagonal removed)
    block: int
    buckets: tuple[RowBucket, ...]
    empty_rows: torch.Tensor  #: flat indices of rows with no block (their output is zero)

    @property
    def layout_heads(self) -> int:
        return self.layout.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.layout.shape[1]

    @property
    def nnz(self) -> int:
        return int(self.layout.sum())

    def padded_nnz(self) -> int:
        return sum(b.cols.numel() for b in self.buckets)

    def to(self, device: torch.device) -> "BlockLUT":
        return BlockLUT(self.layout.to(device), self.block,
                        tuple(b.to(device) for b in self.buckets), self.empty_rows.to(device))


def compress_heads(layout: torch.Tensor) -> torch.Tensor:
    """``layout[:1]`` when every head has the same layout (one gather then serves all heads)."""
    if layout.shape[0] > 1 and bool((layout == layout[:1]).all()):
        return layout[:1]
    return layout


def build_lut(layout: torch.Tensor, block: int, causal: bool, max_padding: float = 0.25) -> BlockLUT:
    """Bucket the rows of ``layout`` ([heads, nb, nb], nonzero = present).

    ``max_padding`` bounds the padded slots of a bucket to that fraction of its widest row.
    """
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"a layout must be [heads, num_blocks, num_blocks], got {tuple(layout.shape)}")
    present = compress_heads(layout.detach().to("cpu") != 0)
    heads, nb, _ = present.shape
    if causal:  # blocks strictly above the diagonal hold only future keys
        present = present & torch.ones(nb, nb, dtype=torch.bool).tril()
    flat = present.reshape(heads * nb, nb)
    counts = flat.sum(1)
    order = torch.argsort(counts, descending=True, stable=True)
    sorted_counts = counts[order].tolist()
    negated = [-c for c in sorted_counts]  # ascending, for bisect

    buckets = []
    start = 0
    total = len(sorted_counts)
    while start < total and sorted_counts[start] > 0:
        width = sorted_counts[start]
        floor = math.floor(width * (1.0 - max_padding))
        stop = bisect.bisect_left(negated, -max(floor, 0), lo=start)
        rows = order[start:stop]
        # Stable sort puts the present columns first, in increasing column order.
        vals, col_block = flat[rows].to(torch.int8).sort(dim=1, descending=True, stable=True)
        col_block = col_block[:, :width].contiguous()
        head = rows // nb
        buckets.append(
            RowBucket(
                rows=rows.contiguous(),
                cols=(head[:, None] * nb + col_block).contiguous(),
                row_block=(rows % nb).contiguous(),
                col_block=col_block,
                valid=(vals[:, :width] > 0).contiguous(),
            )
        )
        start = stop
    empty_rows = order[start:].contiguous()
    return BlockLUT(present, block, tuple(buckets), empty_rows)
