"""Block-sparse attention on the Numba-CUDA kernels, as a torch autograd function.

``zkit_sparse.SparseSelfAttention`` calls :func:`block_sparse_attention` for CUDA tensors. The
forward is SDD (scores of the nonzero blocks), the fused softmax (scale, causal, key-padding and
attention masks) and DSD (probabilities x V); the backward is SDD (dO x V^T), transposed DSD
(dV = P^T dO), the softmax backward, DSD (dQ = dS K) and transposed DSD (dK = dS^T Q). The
probabilities of the nonzero blocks are kept for the backward (memory proportional to the
number of nonzero blocks). fp32 and fp16 inputs are read directly, bf16 is widened to fp32 first
(Numba has no bf16 arrays); all products accumulate in fp32.

Under the CUDA simulator the same function runs on CPU tensors, which is how the test-suite
checks the kernels against the PyTorch reference without a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from zkit_cuda_numba import runtime
from zkit_cuda_numba.block_lut import KernelLUT, build_kernel_lut

#: kernel tiling, repeated here so that importing this module does not import numba
TILE = 16
SUPPORTED_BLOCKS = (16, 32, 64)


def kernels():
    """The kernel module (imports numba on first use)."""
    from zkit_cuda_numba import block_sparse_kernels

    return block_sparse_kernels

__all__ = ["SUPPORTED_BLOCKS", "block_sparse_attention", "build_kernel_lut", "unavailable_reason", "sdd", "dsd",
           "softmax_forward", "softmax_backward"]

unavailable_reason = runtime.unavailable_reason

_GRID_CAP_GPU = 65535
_GRID_CAP_SIM = 4  # the simulator starts a Python thread per CUDA thread: few blocks, grid-stride


def _grid(tiles: int, bg: int) -> tuple[int, int]:
    cap = _GRID_CAP_SIM if runtime.simulator_enabled() else _GRID_CAP_GPU
    return (max(1, min(tiles, cap)), bg)


def _arr(t: torch.Tensor):
    return runtime.as_kernel_array(t)


def _dummy(device) -> torch.Tensor:
    return torch.zeros(1, 1, dtype=torch.float32, device=device)


def sdd(a: torch.Tensor, b: torch.Tensor, lut: KernelLUT) -> torch.Tensor:
    """``[BG, nnz, block, block]`` fp32: ``A_i B_j^T`` for every nonzero block (i, j)."""
    bg, _, dim = a.shape
    out = torch.empty(bg, lut.nnz, lut.block, lut.block, dtype=torch.float32, device=a.device)
    side = lut.block // TILE
    grid = _grid(lut.nnz * side * side, bg)
    kernels().sdd[grid, (TILE, TILE), runtime.launch_stream(a.device)](
        _arr(a), _arr(b), _arr(out), _arr(lut.nz_head), _arr(lut.nz_row), _arr(lut.nz_col),
        lut.block, lut.seq, dim)
    return out


def dsd(sparse: torch.Tensor, b: torch.Tensor, lut: KernelLUT, transpose: bool) -> torch.Tensor:
    """``[BG, Hl * T, D]`` fp32: ``S @ B`` (or ``S^T @ B``) with ``S`` the sparse blocks."""
    bg, _, dim = b.shape
    out = torch.empty(bg, b.shape[1], dim, dtype=torch.float32, device=b.device)
    ptr, idx, other = ((lut.col_ptr, lut.col_nz, lut.nz_row) if transpose
                       else (lut.row_ptr, lut.row_nz, lut.nz_col))
    side = lut.block // TILE
    tiles = (ptr.numel() - 1) * side * ((dim + TILE - 1) // TILE)
    kernels().dsd[_grid(tiles, bg), (TILE, TILE), runtime.launch_stream(b.device)](
        _arr(sparse), _arr(b), _arr(out), _arr(ptr), _arr(idx), _arr(other), bool(transpose),
        lut.block, lut.seq, dim)
    return out


def softmax_forward(scores: torch.Tensor, lut: KernelLUT, scale: float, groups: int,
                    key_padding: torch.Tensor | None, attn_mask: torch.Tensor | None,
                    causal: bool) -> torch.Tensor:
    """In place on ``scores``; returns the log-sum-exp ``[BG, Hl * T]`` (+inf: fully masked)."""
    bg = scores.shape[0]
    device = scores.device
    lse = torch.empty(bg, lut.layout_heads * lut.seq, dtype=torch.float32, device=device)
    kp = _dummy(device) if key_padding is None else key_padding.float().contiguous()
    am = _dummy(device) if attn_mask is None else attn_mask.float().contiguous()
    grid = _grid(lut.row_ptr.numel() - 1, bg)
    kernels().softmax_fwd[grid, lut.block, runtime.launch_stream(device)](
        _arr(scores), _arr(lse), _arr(lut.row_ptr), _arr(lut.nz_col),
        lut.block, lut.seq, np.float32(scale), _arr(kp), _arr(am), groups,
        key_padding is not None, attn_mask is not None, bool(causal))
    return lse


def softmax_backward(probs: torch.Tensor, grad: torch.Tensor, lut: KernelLUT, scale: float) -> torch.Tensor:
    """In place on ``grad``: the gradient of the (scaled) scores."""
    grid = _grid(lut.row_ptr.numel() - 1, probs.shape[0])
    kernels().softmax_bwd[grid, lut.block, runtime.launch_stream(probs.device)](
        _arr(probs), _arr(grad), _arr(lut.row_ptr), lut.block, np.float32(scale))
    return grad


class _KernelAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lut, scale, key_padding, attn_mask, causal, dropout):
        b, h, t, d = q.shape
        groups = h // lut.layout_heads
        shape = (b * groups, lut.layout_heads * t, d)
        work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
        qf, kf, vf = (x.to(work).contiguous().view(shape) for x in (q, k, v))
        probs = sdd(qf, kf, lut)
        softmax_forward(probs, lut, scale, groups, key_padding, attn_mask, causal)
        keep = None
        used = probs
        if dropout > 0.0:
            keep = torch.rand_like(probs) >= dropout
            used = probs * keep / (1.0 - dropout)
        out = dsd(used, vf, lut, transpose=False)
        ctx.save_for_backward(qf, kf, vf, probs, keep)
        ctx.lut, ctx.scale, ctx.dropout, ctx.in_dtype = lut, scale, dropout, q.dtype
        return out.view(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, vf, probs, keep = ctx.saved_tensors
        lut, scale, dropout = ctx.lut, ctx.scale, ctx.dropout
        dof = grad_out.to(qf.dtype).contiguous().view(qf.shape)
        dp = sdd(dof, vf, lut)
        used = probs if keep is None else probs * keep / (1.0 - dropout)
        dv = dsd(used, dof, lut, transpose=True)
        if keep is not None:
            dp.mul_(keep).div_(1.0 - dropout)
        ds = softmax_backward(probs, dp, lut, scale)
        dq = dsd(ds, kf, lut, transpose=False)
        dk = dsd(ds, qf, lut, transpose=True)
        shape, dtype = grad_out.shape, ctx.in_dtype
        return (dq.view(shape).to(dtype), dk.view(shape).to(dtype), dv.view(shape).to(dtype),
                None, None, None, None, None, None)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lut: KernelLUT,
                           scale: float, key_padding: torch.Tensor | None = None,
                           attn_mask: torch.Tensor | None = None, causal: bool = False,
                           dropout: float = 0.0) -> torch.Tensor:
    """Attention of ``[B, H, T, d]`` tensors over the nonzero blocks of ``lut``.

    ``key_padding`` ([B, T]) and ``attn_mask`` ([T, T]) are additive (``-inf`` = masked).
    """
    runtime.require()
    if lut.block not in SUPPORTED_BLOCKS:
        raise ValueError(f"the CUDA kernels support block sizes {SUPPORTED_BLOCKS}, got {lut.block}")
    if q.shape[2] != lut.seq:
        raise ValueError(f"sequence length {q.shape[2]} does not match the lookup table's {lut.seq}")
    if q.shape[1] % lut.layout_heads:
        raise ValueError(f"{q.shape[1]} heads cannot share a layout of {lut.layout_heads} heads")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the CUDA kernels take fp32, fp16 or bf16 tensors, got {q.dtype}")
    return _KernelAttentionFn.apply(q, k, v, lut, scale, key_padding, attn_mask, causal, dropout)
