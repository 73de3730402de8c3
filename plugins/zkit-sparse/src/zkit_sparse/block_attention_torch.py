"""Block-sparse attention in batched PyTorch ops: the CPU path (and the CUDA fallback).

Only the nonzero blocks are computed. For each row bucket of the :class:`BlockLUT` the key and
value blocks of every row are gathered into ``[B, G, n, R * block, d]`` and scores, softmax and
the probability-value product are dense batched matmuls over ``[B, G, n, block, R * block]``
tiles. Like FlashAttention, the forward keeps only the output and each row's log-sum-exp; the
backward recomputes the probabilities chunk by chunk. Memory is therefore O(seq * head_dim) plus
one bounded chunk of scores, and the seq x seq matrix is never materialised.

Shapes: ``[B, H, T, d]`` is viewed as ``[B, G, layout_heads * nb, block, d]`` with
``G = H / layout_heads`` (a layout shared by all heads has ``layout_heads == 1``), so one index
along the block axis gathers every head that shares a layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zkit_sparse.block_lut import BlockLUT, RowBucket


@dataclass(frozen=True)
class MaskSpec:
    """Masks already converted to additive fp32 form (``-inf`` = masked)."""

    key_padding: torch.Tensor | None  #: [B, T]
    attn: torch.Tensor | None  #: [T, T]
    causal: bool


def _chunks(lut: BlockLUT, batch_heads: int, workspace_elems: int):
    """(bucket, row slice, chunk id) with at most ``workspace_elems`` scores per chunk."""
    chunk_id = 0
    tile = lut.block * lut.block
    for bucket in lut.buckets:
        per_row = batch_heads * tile * bucket.width
        rows = max(1, workspace_elems // per_row)
        for lo in range(0, bucket.rows.numel(), rows):
            yield bucket, slice(lo, lo + rows), chunk_id
            chunk_id += 1


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: fp32 for 16-bit and fp32 inputs, fp64 for fp64 (the test reference)."""
    return torch.promote_types(dtype, torch.float32)


def _bias(bucket: RowBucket, sl: slice, block: int, masks: MaskSpec, device, dtype) -> torch.Tensor:
    """Additive bias ``[B or 1, 1, n, block, R * block]``: pad slots, causal, padding, attn mask."""
    valid = bucket.valid[sl]  # [n, R]
    n, width = valid.shape
    bias = torch.zeros(n, block, width, block, device=device, dtype=dtype)
    bias.masked_fill_(~valid[:, None, :, None], float("-inf"))
    if masks.causal:
        r = torch.arange(block, device=device)
        q_pos = bucket.row_block[sl][:, None, None, None] * block + r[None, :, None, None]
        k_pos = bucket.col_block[sl][:, None, :, None] * block + r[None, None, None, :]
        bias.masked_fill_(k_pos > q_pos, float("-inf"))
    if masks.attn is not None:
        t = masks.attn.shape[0]
        nb = t // block
        am = masks.attn.view(nb, block, nb, block)
        bias += am[bucket.row_block[sl][:, None], :, bucket.col_block[sl], :].permute(0, 2, 1, 3)
    bias = bias.view(1, 1, n, block, width * block)
    if masks.key_padding is not None:
        b = masks.key_padding.shape[0]
        kp = masks.key_padding.view(b, -1, block)[:, bucket.col_block[sl]]  # [B, n, R, block]
        bias = bias + kp.reshape(b, 1, n, 1, width * block)
    return bias


def _probs(q, k, bias, lse, scale):
    s = torch.matmul(q, k.transpose(-1, -2)).to(lse.dtype)
    s.mul_(scale).add_(bias)
    return torch.exp_(s.sub_(lse))


def _dropout_keep(shape, p: float, seed: int, chunk_id: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1_000_003 * chunk_id)
    return torch.rand(shape, generator=gen, device=device) >= p


class BlockSparseAttentionFn(torch.autograd.Function):
    """``softmax(scale * Q K^T + masks) V`` over the blocks of a :class:`BlockLUT`."""

    @staticmethod
    def forward(ctx, q, k, v, lut: BlockLUT, masks: MaskSpec, scale: float, dropout: float,
                seed: int, workspace_elems: int):
        b, h, t, d = q.shape
        blk, hl = lut.block, lut.layout_heads
        g = h // hl
        shape = (b, g, hl * (t // blk), blk, d)
        qb, kb, vb = (x.contiguous().view(shape) for x in (q, k, v))
        out = torch.zeros_like(qb)
        acc = _acc_dtype(q.dtype)
        lse = torch.full(shape[:-1] + (1,), float("inf"), device=q.device, dtype=acc)
        for bucket, sl, cid in _chunks(lut, b * g, workspace_elems):
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            n, width = cols.shape
            qr = qb.index_select(2, rows)
            kg = kb.index_select(2, cols.reshape(-1)).view(b, g, n, width * blk, d)
            vg = vb.index_select(2, cols.reshape(-1)).view(b, g, n, width * blk, d)
            s = torch.matmul(qr, kg.transpose(-1, -2)).to(acc)
            s.mul_(scale).add_(_bias(bucket, sl, blk, masks, q.device, acc))
            m = s.amax(-1, keepdim=True)
            m.masked_fill_(torch.isinf(m), 0.0)  # fully masked rows: exp(-inf) = 0, not NaN
            p = torch.exp_(s.sub_(m))
            denom = p.sum(-1, keepdim=True)
            lse.index_copy_(2, rows, torch.where(denom > 0, m + denom.log(), float("inf")))
            p.div_(denom.clamp_min(torch.finfo(p.dtype).tiny))
            if dropout > 0.0:
                p.mul_(_dropout_keep(p.shape, dropout, seed, cid, q.device)).div_(1.0 - dropout)
            out.index_copy_(2, rows, torch.matmul(p.to(vg.dtype), vg))
        ctx.save_for_backward(qb, kb, vb, out, lse)
        ctx.lut, ctx.masks, ctx.scale = lut, masks, scale
        ctx.dropout, ctx.seed, ctx.workspace_elems = dropout, seed, workspace_elems
        return out.view(b, h, t, d)

    @staticmethod
    def backward(ctx, grad_out):
        qb, kb, vb, out, lse = ctx.saved_tensors
        lut, masks, scale, dropout = ctx.lut, ctx.masks, ctx.scale, ctx.dropout
        b, g, _, blk, d = qb.shape
        dob = grad_out.contiguous().view(qb.shape)
        acc = lse.dtype
        delta = (dob.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qb)
        dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
        dv = torch.zeros_like(dk)
        for bucket, sl, cid in _chunks(lut, b * g, ctx.workspace_elems):
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            n, width = cols.shape
            flat_cols = cols.reshape(-1)
            qr = qb.index_select(2, rows)
            dor = dob.index_select(2, rows)
            kg = kb.index_select(2, flat_cols).view(b, g, n, width * blk, d)
            vg = vb.index_select(2, flat_cols).view(b, g, n, width * blk, d)
            bias = _bias(bucket, sl, blk, masks, qb.device, acc)
            p = _probs(qr, kg, bias, lse.index_select(2, rows), scale)
            dp = torch.matmul(dor, vg.transpose(-1, -2)).to(acc)
            if dropout > 0.0:
                keep = _dropout_keep(p.shape, dropout, ctx.seed, cid, qb.device)
                pd = p * keep / (1.0 - dropout)
                dp.mul_(keep).div_(1.0 - dropout)
            else:
                pd = p
            dvg = torch.matmul(pd.transpose(-1, -2).to(dor.dtype), dor)
            dv.index_add_(2, flat_cols, dvg.view(b, g, n * width, blk, d).to(dv.dtype))
            ds = p.mul_(dp.sub_(delta.index_select(2, rows))).mul_(scale).to(qr.dtype)
            dq.index_copy_(2, rows, torch.matmul(ds, kg))
            dkg = torch.matmul(ds.transpose(-1, -2), qr)
            dk.index_add_(2, flat_cols, dkg.view(b, g, n * width, blk, d).to(dk.dtype))
        shape = grad_out.shape
        return (dq.view(shape), dk.to(kb.dtype).view(shape), dv.to(vb.dtype).view(shape),
                None, None, None, None, None, None)


def block_sparse_attention(q, k, v, lut: BlockLUT, masks: MaskSpec, scale: float,
                           dropout: float = 0.0, workspace_elems: int = 1 << 22) -> torch.Tensor:
    """Attention of ``[B, H, T, d]`` tensors over the nonzero blocks of ``lut``."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout > 0.0 else 0
    return BlockSparseAttentionFn.apply(q, k, v, lut, masks, scale, dropout, seed, workspace_elems)
