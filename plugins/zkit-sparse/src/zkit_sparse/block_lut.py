"""Row buckets: the lookup table the PyTorch block-sparse path runs on.

Every (layout head, query block) row of the layout lists the key blocks it attends to. Rows are
grouped into buckets and each bucket's column lists are padded to the bucket's longest, so one
bucket is a handful of dense batched matmuls over ``[rows, block, R * block]`` score tiles. Which
rows share a bucket is chosen by a cost model: a pad slot costs a block of wasted matmul work, a
bucket costs a fixed overhead of about twenty tensor ops; :func:`partition_widths` minimises the
sum exactly. With 64-wide blocks a pad slot costs more than a bucket, so rows of every distinct
length get their own bucket and no work is wasted; small blocks merge neighbouring lengths. Each
row belongs to exactly one bucket, so a row's softmax never spans buckets.

Columns are stored in increasing order, pad slots last, so under causal masking a row's diagonal
block (its largest column) is its last valid slot: the intra-block causal mask then touches one
``block x block`` tile per row instead of the whole score row.
"""
from __future__ import annotations

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
    #: Static score mask [n, block, R * block] (True = masked) for pad slots and causal diagonal
    #: blocks not in the last slot; None when the bucket needs at most ``causal_tail``.
    tile_mask: torch.Tensor | None
    #: Every row's diagonal block is its last slot and nothing else is masked: causal masking is
    #: one upper-triangular fill of the last ``block x block`` tile of each row.
    causal_tail: bool

    @property
    def width(self) -> int:
        return self.cols.shape[1]

    def to(self, device: torch.device) -> "RowBucket":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return RowBucket(move(self.rows), move(self.cols), move(self.row_block),
                         move(self.col_block), move(self.valid), move(self.tile_mask),
                         self.causal_tail)


@dataclass(frozen=True)
class BlockLUT:
    """The layout of one attention call, bucketed for the PyTorch path."""

    layout: torch.Tensor  #: [layout_heads, nb, nb] bool (causal: blocks above the diagonal removed)
    block: int
    causal: bool
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
        return BlockLUT(self.layout.to(device), self.block, self.causal,
                        tuple(b.to(device) for b in self.buckets), self.empty_rows.to(device))


def compress_heads(layout: torch.Tensor) -> torch.Tensor:
    """``layout[:1]`` when every head has the same layout (one gather then serves all heads)."""
    if layout.shape[0] > 1 and bool((layout == layout[:1]).all()):
        return layout[:1]
    return layout


def partition_widths(widths: list[int], counts: list[int], bucket_overhead: float) -> list[int]:
    """Optimal split of rows, sorted by length, into buckets.

    ``widths`` are the distinct row lengths in decreasing order and ``counts[i]`` the number of
    rows of length ``widths[i]``. A bucket spanning ``widths[a:b]`` costs
    ``widths[a] * sum(counts[a:b]) + bucket_overhead`` (slots, pads included, plus the fixed cost
    in slots). Returns the start index of every bucket; minimised exactly by dynamic programming
    (``len(widths)`` is at most the number of blocks per row).
    """
    k = len(widths)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    best = [0.0] + [float("inf")] * k  # best[j]: cost of the first j widths
    split = [0] * (k + 1)
    for j in range(1, k + 1):
        for a in range(j):
            cost = best[a] + widths[a] * (prefix[j] - prefix[a]) + bucket_overhead
            if cost < best[j]:
                best[j], split[j] = cost, a
    starts, j = [], k
    while j > 0:
        starts.append(split[j])
        j = split[j]
    return starts[::-1]


def _tile_mask(valid: torch.Tensor, row_block: torch.Tensor, col_block: torch.Tensor,
               block: int, causal: bool) -> torch.Tensor:
    """[n, block, R * block] True where a score is masked (pad slot or future key)."""
    n, width = valid.shape
    masked = (~valid)[:, None, :, None].expand(n, block, width, block)
    if causal:
        r = torch.arange(block, device="cpu")
        q_pos = row_block[:, None, None, None] * block + r[None, :, None, None]
        k_pos = col_block[:, None, :, None] * block + r[None, None, None, :]
        masked = masked | (k_pos > q_pos)
    return masked.reshape(n, block, width * block).contiguous()


def build_lut(layout: torch.Tensor, block: int, causal: bool,
              bucket_overhead: float = 0.0) -> BlockLUT:
    """Bucket the rows of ``layout`` ([heads, nb, nb], nonzero = present).

    ``bucket_overhead``: the fixed cost of one more bucket, in pad slots (one block of one row);
    0 gives one bucket per distinct row length and no padding.
    """
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"a layout must be [heads, num_blocks, num_blocks], got {tuple(layout.shape)}")
    if bucket_overhead < 0:
        raise ValueError(f"bucket_overhead must be >= 0, got {bucket_overhead}")
    present = compress_heads(layout.detach().to("cpu") != 0)
    heads, nb, _ = present.shape
    if causal:  # blocks strictly above the diagonal hold only future keys
        present = present & torch.ones(nb, nb, dtype=torch.bool, device=present.device).tril()
    flat = present.reshape(heads * nb, nb)
    counts = flat.sum(1)
    order = torch.argsort(counts, descending=True, stable=True)
    sorted_counts = counts[order]
    nonempty = int((sorted_counts > 0).sum())
    widths, per_width = torch.unique_consecutive(sorted_counts[:nonempty], return_counts=True)
    starts = partition_widths(widths.tolist(), per_width.tolist(), bucket_overhead)
    row_starts = torch.cat([torch.zeros(1, dtype=torch.long, device=per_width.device), per_width.cumsum(0)]).tolist()

    buckets = []
    for s, e in zip(starts, starts[1:] + [len(widths)]):
        rows = order[row_starts[s]:row_starts[e]]
        width = int(widths[s])
        # Present columns first in increasing order (stable sort of the 0/1 row), pads after.
        vals, col_block = flat[rows].to(torch.int8).sort(dim=1, descending=True, stable=True)
        col_block, valid = col_block[:, :width].contiguous(), (vals[:, :width] > 0).contiguous()
        row_block = rows % nb
        all_valid = bool(valid.all())
        if causal:
            causal_tail = all_valid and bool((col_block[:, -1] == row_block).all())
            needs_mask = not causal_tail
        else:
            causal_tail, needs_mask = False, not all_valid
        head = rows // nb
        buckets.append(RowBucket(
            rows=rows.contiguous(),
            cols=(head[:, None] * nb + col_block).contiguous(),
            row_block=row_block.contiguous(),
            col_block=col_block,
            valid=valid,
            tile_mask=_tile_mask(valid, row_block, col_block, block, causal) if needs_mask else None,
            causal_tail=causal_tail,
        ))
    empty_rows = order[nonempty:].contiguous()
    return BlockLUT(present, block, causal, tuple(buckets), empty_rows)
