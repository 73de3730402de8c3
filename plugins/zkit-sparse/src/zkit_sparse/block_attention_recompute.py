"""Block-sparse attention that recomputes the probabilities in the backward (low memory).

Like FlashAttention, the forward keeps only the output and each row's log-sum-exp; the backward
recomputes ``P = exp(S - lse)`` chunk by chunk. Memory is O(seq * head_dim) plus one chunk of
``workspace_elems`` scores, whatever the number of nonzero blocks; the price is one more block
matmul and exponential per nonzero block than :class:`BlockSparseAttentionFn`. Same buckets,
masks and shapes as :mod:`zkit_sparse.block_attention_torch`.
"""
from __future__ import annotations

import torch

from zkit_sparse.block_attention_torch import _blocked, _gather
from zkit_sparse.block_lut import BlockLUT
from zkit_sparse.block_masks import MaskSpec, acc_dtype, chunks, dropout_keep, mask_scores_


class RecomputeBlockSparseAttentionFn(torch.autograd.Function):
    """``softmax(scale * Q K^T + masks) V`` over the blocks of a :class:`BlockLUT`, saving only
    the output and the per-row log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, lut: BlockLUT, masks: MaskSpec, scale: float, dropout: float,
                seed: int, workspace_elems: int):
        qs = _blocked(lut, q) * scale
        kb, vb = _blocked(lut, k), _blocked(lut, v)
        b, g, _, _, d = qs.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros_like(qs)
        lse = torch.full(qs.shape[:-1] + (1,), float("inf"), device=q.device, dtype=acc)
        for bucket, sl, cid in chunks(lut, b * g, workspace_elems):
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            flat_cols = cols.reshape(-1)
            kg = _gather(kb, flat_cols).view(b, g, len(rows), -1, d)
            s = torch.matmul(qs.index_select(2, rows), kg.transpose(-1, -2))
            s = mask_scores_(s.to(acc), bucket, sl, lut.block, masks)
            m = s.amax(-1, keepdim=True)
            m.masked_fill_(torch.isinf(m), 0.0)  # fully masked rows: exp(-inf) = 0, not NaN
            p = torch.exp_(s.sub_(m))
            denom = p.sum(-1, keepdim=True)
            lse.index_copy_(2, rows, torch.where(denom > 0, m + denom.log(), float("inf")))
            p.div_(denom.clamp_min(torch.finfo(p.dtype).tiny))
            if dropout > 0.0:
                p.mul_(dropout_keep(p.shape, dropout, seed, cid, q.device)).div_(1.0 - dropout)
            vg = _gather(vb, flat_cols).view(b, g, len(rows), -1, d)
            out.index_copy_(2, rows, torch.matmul(p.to(vg.dtype), vg))
        ctx.save_for_backward(qs, kb, vb, out, lse)
        ctx.lut, ctx.masks, ctx.scale = lut, masks, scale
        ctx.dropout, ctx.seed, ctx.workspace_elems = dropout, seed, workspace_elems
        return out.view(q.shape)

    @staticmethod
    def backward(ctx, grad_out):
        qs, kb, vb, out, lse = ctx.saved_tensors
        lut, masks, dropout = ctx.lut, ctx.masks, ctx.dropout
        b, g, _, blk, d = qs.shape
        dob = _blocked(lut, grad_out)
        acc = lse.dtype
        delta = (dob.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qs)
        dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
        dv = torch.zeros_like(dk)
        for bucket, sl, cid in chunks(lut, b * g, ctx.workspace_elems):
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            n, width = cols.shape
            flat_cols = cols.reshape(-1)
            qr = qs.index_select(2, rows)
            dor = dob.index_select(2, rows)
            kg = _gather(kb, flat_cols).view(b, g, n, -1, d)
            s = mask_scores_(torch.matmul(qr, kg.transpose(-1, -2)).to(acc), bucket, sl, blk, masks)
            p = torch.exp_(s.sub_(lse.index_select(2, rows)))
            dp = torch.matmul(dor, _gather(vb, flat_cols).view(b, g, n, -1, d).transpose(-1, -2)).to(acc)
            pd = p
            if dropout > 0.0:
                keep = dropout_keep(p.shape, dropout, ctx.seed, cid, qs.device)
                pd = p * keep / (1.0 - dropout)
                dp.mul_(keep).div_(1.0 - dropout)
            dvg = torch.matmul(pd.transpose(-1, -2).to(dor.dtype), dor)
            dv.index_add_(2, flat_cols, dvg.view(b, g, n * width, blk, d).to(acc))
            ds = p.mul_(dp.sub_(delta.index_select(2, rows))).to(qs.dtype)
            dq.index_copy_(2, rows, torch.matmul(ds, kg))
            dkg = torch.matmul(ds.transpose(-1, -2), qr)
            dk.index_add_(2, flat_cols, dkg.view(b, g, n * width, blk, d).to(acc))
        dq.mul_(ctx.scale)
        shape = grad_out.shape
        return (dq.view(shape), dk.to(kb.dtype).view(shape), dv.to(vb.dtype).view(shape),
                None, None, None, None, None, None)
