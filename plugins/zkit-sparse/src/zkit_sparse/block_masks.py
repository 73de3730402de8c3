"""Masks and chunking shared by the two PyTorch block-sparse paths.

Scores of one chunk are ``[B, G, n, block, R * block]``: ``n`` rows of a :class:`RowBucket`,
each with its ``R`` key blocks side by side. Pad slots and future keys are masked from the
bucket's static mask (or, when the only masking is causal, from one upper-triangular fill of each
row's last tile); the user's key-padding and attention masks are added as a bias.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from zkit_sparse.block_lut import BlockLUT, RowBucket


@dataclass(frozen=True)
class MaskSpec:
    """Masks already converted to additive fp32 form (``-inf`` = masked)."""

    key_padding: torch.Tensor | None  #: [B, T]
    attn: torch.Tensor | None  #: [T, T]
    causal: bool

    @property
    def has_user_masks(self) -> bool:
        """A row may lose every key (then its probabilities are zeros, not NaN)."""
        return self.key_padding is not None or self.attn is not None


def chunks(lut: BlockLUT, batch_heads: int, workspace_elems: int
           ) -> Iterator[tuple[RowBucket, slice, int]]:
    """(bucket, row slice, chunk id) with at most ``workspace_elems`` scores per chunk."""
    chunk_id = 0
    tile = lut.block * lut.block
    for bucket in lut.buckets:
        per_row = batch_heads * tile * bucket.width
        rows = max(1, workspace_elems // per_row)
        for lo in range(0, bucket.rows.numel(), rows):
            yield bucket, slice(lo, lo + rows), chunk_id
            chunk_id += 1


def chunk_extents(lut: BlockLUT, batch_heads: int, workspace_elems: int) -> tuple[int, int]:
    """The most rows and the most row x key-block slots of any chunk of :func:`chunks`."""
    max_rows = max_slots = 0
    for bucket, sl, _ in chunks(lut, batch_heads, workspace_elems):
        n = len(range(*sl.indices(bucket.rows.numel())))
        max_rows, max_slots = max(max_rows, n), max(max_slots, n * bucket.width)
    return max_rows, max_slots


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: fp32 for 16-bit and fp32 inputs, fp64 for fp64 (the test reference)."""
    return torch.promote_types(dtype, torch.float32)


def mask_scores_(s: torch.Tensor, bucket: RowBucket, sl: slice, block: int,
                 masks: MaskSpec) -> torch.Tensor:
    """Mask the scores ``s`` ([B, G, n, block, R * block]) of rows ``sl`` of ``bucket`` in place."""
    if bucket.tile_mask is not None:
        s.masked_fill_(bucket.tile_mask[sl], float("-inf"))
    elif bucket.causal_tail:
        s[..., -block:].masked_fill_(_future_keys(block, s.device), float("-inf"))
    if masks.has_user_masks:
        s.add_(_user_bias(bucket, sl, block, masks, s.dtype))
    return s


@functools.lru_cache(maxsize=16)
def _future_keys(block: int, device: torch.device) -> torch.Tensor:
    """[block, block] True above the diagonal: keys after the query inside a diagonal block."""
    return torch.ones(block, block, dtype=torch.bool, device=device).triu_(1)


def _user_bias(bucket: RowBucket, sl: slice, block: int, masks: MaskSpec,
               dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B or 1, 1, n, block, R * block]`` bias of the key-padding and attention masks."""
    n, width = bucket.cols[sl].shape
    bias = torch.zeros((), dtype=dtype, device=bucket.cols.device)
    if masks.attn is not None:
        nb = masks.attn.shape[0] // block
        am = masks.attn.view(nb, block, nb, block).to(dtype)
        tiles = am[bucket.row_block[sl][:, None], :, bucket.col_block[sl], :]  # [n, R, blk, blk]
        bias = tiles.permute(0, 2, 1, 3).reshape(1, 1, n, block, width * block)
    if masks.key_padding is not None:
        b = masks.key_padding.shape[0]
        kp = masks.key_padding.view(b, -1, block)[:, bucket.col_block[sl]].to(dtype)
        bias = bias + kp.reshape(b, 1, n, 1, width * block)
    return bias


def dropout_keep(shape, p: float, seed: int, chunk_id: int, device) -> torch.Tensor:
    """The keep mask of one chunk, regenerated identically by the backward."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1_000_003 * chunk_id)
    return torch.rand(shape, generator=gen, device=device) >= p
