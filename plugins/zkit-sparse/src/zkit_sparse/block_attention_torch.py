"""Block-sparse attention in batched PyTorch ops: the CPU path (and the CUDA fallback).

Only the nonzero blocks are computed. For each row bucket of the :class:`BlockLUT` the key and
value blocks of every row are gathered into ``[B, G, n, R * block, d]`` and scores, softmax and
the probability-value product are dense batched matmuls over ``[B, G, n, block, R * block]``
tiles. This module's path keeps the block-sparse probabilities for the backward, as DeepSpeed's
sparse softmax does: six block matmuls per nonzero block in all and a fused softmax and softmax
backward, with memory proportional to the nonzero blocks times ``block**2``.
:mod:`zkit_sparse.block_attention_recompute` is the FlashAttention-style alternative that keeps
only the output and log-sum-exp and recomputes the probabilities chunk by chunk.

Shapes: ``[B, H, T, d]`` is viewed as ``[B, G, layout_heads * nb, block, d]`` with
``G = H / layout_heads`` (a layout shared by all heads has ``layout_heads == 1``), so one index
along the block axis gathers every head that shares a layout. The scale is folded into a copy of
Q, so scores come out of the matmul scaled and dK needs no extra pass. Every per-chunk temporary
is written with ``out=`` into a :class:`Workspace`, and the saved probabilities go to a
:class:`ReusableBuffer`: on CPU, fresh multi-MiB tensors per chunk cost more in page faults than
the copies that fill them.
"""
from __future__ import annotations

import torch

from zkit_sparse.block_lut import BlockLUT
from zkit_sparse.block_masks import (MaskSpec, acc_dtype, chunk_extents, chunks, dropout_keep,
                                     mask_scores_)
from zkit_sparse.reusable_buffer import ReusableBuffer, Workspace

__all__ = ["BlockSparseAttentionFn", "MaskSpec", "block_sparse_attention"]

#: Scratch memory of the chunk loops, shared by every module (calls run one at a time; a buffer
#: still referenced is never handed out twice).
_SCRATCH = ReusableBuffer()


def _blocked(lut: BlockLUT, x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.contiguous().view(b, h // lut.layout_heads, lut.layout_heads * (t // lut.block),
                               lut.block, d)


def _gather(xb: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``index`` of ``xb`` ([B, G, N, block, d]) side by side: [B, G, len(index), block, d]."""
    if out is None:
        return xb.index_select(2, index)
    return torch.index_select(xb, 2, index, out=out)


def _workspace(lut: BlockLUT, x: torch.Tensor, workspace_elems: int, names: dict[str, str],
               scratch: ReusableBuffer | None) -> Workspace:
    """Slots sized for the largest chunk; ``names`` maps a slot to 'rows', 'blocks' or 'scores'."""
    b, g, _, blk, d = x.shape
    max_rows, max_slots = chunk_extents(lut, b * g, workspace_elems)
    per = {"rows": max_rows * blk * d, "blocks": max_slots * blk * d, "scores": max_slots * blk * blk}
    return Workspace({name: b * g * per[kind] for name, kind in names.items()}, x.dtype, x.device,
                     scratch)


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` of [..., m, k] x [..., k, n] into ``out`` [..., m, n] (views, no copies)."""
    torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
              out=out.view(-1, *out.shape[-2:]))
    return out


class BlockSparseAttentionFn(torch.autograd.Function):
    """``softmax(scale * Q K^T + masks) V`` over the blocks of a :class:`BlockLUT`, keeping the
    probabilities of the nonzero blocks for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, lut: BlockLUT, masks: MaskSpec, scale: float, dropout: float,
                seed: int, workspace_elems: int, buffer: ReusableBuffer | None = None,
                scratch: ReusableBuffer | None = _SCRATCH):
        qs = _blocked(lut, q) * scale
        kb, vb = _blocked(lut, k), _blocked(lut, v)
        b, g, _, blk, d = qs.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros_like(qs)
        # The probabilities the backward needs live in one flat tensor, reused across steps when
        # a buffer is given; without gradients they are per-chunk scratch.
        keep = any(ctx.needs_input_grad[:3])
        total = b * g * blk * blk * lut.padded_nnz() if keep else 0
        saved = torch.empty(total, dtype=acc, device=q.device) if buffer is None or not keep \
            else buffer.take(total, acc, q.device)
        names = {"q": "rows", "k": "blocks", "v": "blocks", "s": "scores", "o": "rows"}
        if not keep:
            names["p"] = "scores"
        ws = _workspace(lut, qs, workspace_elems, names, scratch)
        shapes, offset = [], 0
        for bucket, sl, cid in chunks(lut, b * g, workspace_elems):
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            n, width = cols.shape
            flat_cols = cols.reshape(-1)
            qr = _gather(qs, rows, ws.get("q", (b, g, n, blk, d)))
            kg = _gather(kb, flat_cols, ws.get("k", (b, g, n * width, blk, d))).view(b, g, n, -1, d)
            s = _bmm(qr, kg.transpose(-1, -2), ws.get("s", (b, g, n, blk, width * blk)))
            s = mask_scores_(s.to(acc), bucket, sl, blk, masks)
            if keep:
                p = saved[offset:offset + s.numel()].view(s.shape)
                offset += s.numel()
                shapes.append(s.shape)
            else:
                p = ws.get("p", s.shape) if s.dtype == q.dtype else torch.empty_like(s)
            torch.ops.aten._softmax.out(s, -1, False, out=p)
            if masks.has_user_masks:
                p.nan_to_num_(nan=0.0)  # a row with every key masked attends to nothing
            pd = p
            if dropout > 0.0:
                pd = p * dropout_keep(p.shape, dropout, seed, cid, q.device) / (1.0 - dropout)
            vg = _gather(vb, flat_cols, ws.get("v", (b, g, n * width, blk, d))).view(b, g, n, -1, d)
            out.index_copy_(2, rows, _bmm(pd.to(vg.dtype), vg, ws.get("o", qr.shape)))
        ctx.save_for_backward(qs, kb, vb, saved)
        ctx.prob_shapes, ctx.scratch = shapes, scratch
        ctx.lut, ctx.scale = lut, scale
        ctx.dropout, ctx.seed, ctx.workspace_elems = dropout, seed, workspace_elems
        return out.view(q.shape)

    @staticmethod
    def backward(ctx, grad_out):
        qs, kb, vb, saved = ctx.saved_tensors
        lut, dropout = ctx.lut, ctx.dropout
        b, g, _, blk, d = qs.shape
        dob = _blocked(lut, grad_out)
        acc = saved.dtype
        probs = saved.split([shape.numel() for shape in ctx.prob_shapes])
        dq = torch.zeros_like(qs)
        dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
        dv = torch.zeros_like(dk)
        ws = _workspace(lut, qs, ctx.workspace_elems,
                        {"do": "rows", "q": "rows", "dq": "rows", "k": "blocks", "v": "blocks",
                         "g": "blocks", "dp": "scores", "ds": "scores"}, ctx.scratch)
        same = acc == qs.dtype
        for (bucket, sl, cid), p, shape in zip(chunks(lut, b * g, ctx.workspace_elems), probs,
                                               ctx.prob_shapes):
            p = p.view(shape)
            rows, cols = bucket.rows[sl], bucket.cols[sl]
            n, width = cols.shape
            flat_cols = cols.reshape(-1)
            dor = _gather(dob, rows, ws.get("do", (b, g, n, blk, d)))
            vg = _gather(vb, flat_cols, ws.get("v", (b, g, n * width, blk, d))).view(b, g, n, -1, d)
            dp = _bmm(dor, vg.transpose(-1, -2), ws.get("dp", shape)).to(acc)
            pd = p
            if dropout > 0.0:
                keep = dropout_keep(p.shape, dropout, ctx.seed, cid, qs.device)
                pd = p * keep / (1.0 - dropout)
                dp.mul_(keep).div_(1.0 - dropout)
            dvg = _bmm(pd.to(dor.dtype).transpose(-1, -2), dor, ws.get("g", (b, g, n, width * blk, d)))
            dv.index_add_(2, flat_cols, dvg.view(b, g, n * width, blk, d).to(acc))
            # dS = P * (dP - rowsum(dP * P)), one fused kernel; zero where P is zero.
            ds = ws.get("ds", shape) if same else torch.empty_like(dp)
            torch.ops.aten._softmax_backward_data.out(dp, p, -1, acc, grad_input=ds)
            ds = ds.to(qs.dtype)
            kg = _gather(kb, flat_cols, ws.get("k", (b, g, n * width, blk, d))).view(b, g, n, -1, d)
            dq.index_copy_(2, rows, _bmm(ds, kg, ws.get("dq", dor.shape)))
            qr = _gather(qs, rows, ws.get("q", dor.shape))
            dkg = _bmm(ds.transpose(-1, -2), qr, ws.get("g", (b, g, n, width * blk, d)))
            dk.index_add_(2, flat_cols, dkg.view(b, g, n * width, blk, d).to(acc))
        dq.mul_(ctx.scale)  # scores were (scale * Q) K^T: dK already carries the scale
        shape = grad_out.shape
        return (dq.view(shape), dk.to(kb.dtype).view(shape), dv.to(vb.dtype).view(shape),
                None, None, None, None, None, None, None, None)


def block_sparse_attention(q, k, v, lut: BlockLUT, masks: MaskSpec, scale: float,
                           dropout: float = 0.0, workspace_elems: int = 1 << 21,
                           save_probs: bool = True,
                           buffer: ReusableBuffer | None = None) -> torch.Tensor:
    """Attention of ``[B, H, T, d]`` tensors over the nonzero blocks of ``lut``.

    ``save_probs=False`` runs :class:`~zkit_sparse.block_attention_recompute.RecomputeBlockSparseAttentionFn`
    (memory O(T * d) plus one ``workspace_elems`` chunk, one more matmul per block). ``buffer``
    holds the saved probabilities from one call to the next (see :class:`ReusableBuffer`).
    """
    seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item()) if dropout > 0.0 else 0
    if not save_probs:
        from zkit_sparse.block_attention_recompute import RecomputeBlockSparseAttentionFn

        return RecomputeBlockSparseAttentionFn.apply(q, k, v, lut, masks, scale, dropout, seed,
                                                     workspace_elems)
    return BlockSparseAttentionFn.apply(q, k, v, lut, masks, scale, dropout, seed,
                                        workspace_elems, buffer)
