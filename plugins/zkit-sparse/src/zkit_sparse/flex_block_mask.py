"""A FlexAttention ``BlockMask`` built from a block layout, without evaluating the mask per token.

FlexAttention skips work in tiles of its ``BLOCK_SIZE`` (128 by default: on an H100 at head_dim 64
the compiled backward needs tiles that are multiples of 128, see
:mod:`zkit_sparse.flex_backward_tiles`), while zkit layouts use blocks of 16-64 tokens. The
``BlockMask`` is therefore coarser than the layout: a 128 x 128 tile holding some but not all of
its layout blocks is *partial* (the kernel calls ``mask_mod`` there), one holding all of them and
no causal diagonal is *full* (no ``mask_mod``), and one holding none is skipped. With 64-token
blocks most tiles can be partial: the Fixed layout of the GPU bench (4 local blocks, 1 global,
causal, 16384 tokens, 13 % of the blocks) gives 25 % of the 128 x 128 tiles partial and 0.4 %
full, and 0.8 % partial and 13 % full with 128 x 64 tiles.

``create_block_mask`` would find the same tiles by calling ``mask_mod`` on every (query, key)
pair, a ``T x T`` tensor (32 GiB at 16384 tokens without ``_compile=True``). Here the tiles come
from the ``[heads, nb, nb]`` layout by pooling, so building the mask costs ``(T / block)**2``
booleans and no compilation, and :class:`~zkit_sparse.attention.SparseSelfAttention` keeps one
per sequence length.
"""
from __future__ import annotations

import math

import torch

from zkit_sparse.block_lut import compress_heads

#: FlexAttention's tile; the layout is expressed through ``mask_mod`` inside partial tiles.
DEFAULT_FLEX_BLOCK = 128


def flex_tile(flex_block: int | tuple[int, int]) -> tuple[int, int]:
    """``(query tile, key tile)`` of a ``flex_block_size`` option (an int or a pair)."""
    tile = (flex_block, flex_block) if isinstance(flex_block, int) else tuple(flex_block)
    if len(tile) != 2 or any(type(x) is not int or x < 16 or x & (x - 1) for x in tile):
        raise ValueError(f"flex_block_size must be a power of two >= 16 or a pair of them, got {flex_block!r}")
    return tile  # type: ignore[return-value]


def _tile_any_all(fine: torch.Tensor, fq: int, fk: int, pad_q: int, pad_k: int):
    """Per ``fq x fk`` group of ``fine`` cells ([H, nq, nk] bool): any present, all present.
    Cells past the sequence count as absent, so a tile that reaches past it stays partial."""
    fine = torch.nn.functional.pad(fine, (0, pad_k, 0, pad_q), value=False)
    h, nq, nk = fine.shape
    grouped = fine.view(h, nq // fq, fq, nk // fk, fk)
    return grouped.any(4).any(2), grouped.all(4).all(2)


def _kv_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks [1, H, nQ], indices [1, H, nQ, nK])`` int32: the present tiles of each row
    first, as ``BlockMask`` stores them."""
    num = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return num[None], order.to(torch.int32)[None]


def layout_mask_mod(layout: torch.Tensor, block: int, causal: bool):
    """``mask_mod(b, h, q_idx, kv_idx)``: the (query, key) pair lies in a present layout block
    (and, when ``causal``, the key is not after the query). ``layout`` is ``[H or 1, nb, nb]``
    bool, padded to cover every index the tiles reach."""
    if layout.shape[0] == 1:
        shared = layout[0]

        def in_layout(b, h, q_idx, kv_idx):
            return shared[q_idx // block, kv_idx // block]
    else:
        def in_layout(b, h, q_idx, kv_idx):
            return layout[h, q_idx // block, kv_idx // block]

    if not causal:
        return in_layout

    def causal_in_layout(b, h, q_idx, kv_idx):
        return in_layout(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)

    return causal_in_layout


def layout_block_mask(layout: torch.Tensor, block: int, seq_len: int, causal: bool,
                      device: torch.device | str, flex_block: int | tuple[int, int] = DEFAULT_FLEX_BLOCK):
    """The ``BlockMask`` of ``layout`` ([heads, nb, nb], nonzero = present) for ``seq_len`` tokens.

    A layout shared by every head gives a mask with one head (broadcast over the heads)."""
    from torch.nn.attention.flex_attention import BlockMask

    fq, fk = flex_tile(flex_block)
    nb = seq_len // block
    if layout.dim() != 3 or layout.shape[1:] != (nb, nb) or nb * block != seq_len:
        raise ValueError(f"layout {tuple(layout.shape)} at block {block} does not cover {seq_len} tokens")
    layout = compress_heads(layout.to(device="cpu", dtype=torch.bool))
    # Cells of g tokens: g divides the layout block and both tiles, so every cell is one layout
    # block's part and every tile a whole number of cells.
    g = math.gcd(block, fq, fk)
    fine = layout.repeat_interleave(block // g, 1).repeat_interleave(block // g, 2)
    nq_tiles, nk_tiles = -(-seq_len // fq), -(-seq_len // fk)
    pad_q, pad_k = nq_tiles * fq // g - fine.shape[1], nk_tiles * fk // g - fine.shape[2]
    present_any, present_all = _tile_any_all(fine, fq // g, fk // g, pad_q, pad_k)
    if causal:
        # Empty when every key is after every query; needs no mask_mod when none is.
        q_first = torch.arange(nq_tiles, device="cpu")[:, None] * fq
        q_last = q_first + fq - 1
        k_first = torch.arange(nk_tiles, device="cpu")[None, :] * fk
        k_last = k_first + fk - 1
        present_any &= k_first <= q_last
        present_all &= k_last <= q_first
    full = present_all
    partial = present_any & ~present_all
    kv_num, kv_idx = _kv_lists(partial)
    full_num, full_idx = _kv_lists(full)
    # mask_mod indexes the layout with every index a partial tile reaches, past seq_len too.
    reach = max(nq_tiles * fq, nk_tiles * fk)
    nb_pad = -(-reach // block)
    padded = torch.zeros(layout.shape[0], nb_pad, nb_pad, dtype=torch.bool, device="cpu")
    padded[:, :nb, :nb] = layout
    mask_mod = layout_mask_mod(padded.to(device), block, causal)
    return BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=(fq, fk), mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))
