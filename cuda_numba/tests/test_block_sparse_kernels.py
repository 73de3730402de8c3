"""The block-sparse kernels, run by the CUDA simulator, equal the PyTorch reference.

Sizes are tiny on purpose: the simulator runs every CUDA thread as a Python thread.
"""
from __future__ import annotations

import math

import pytest
import torch

from zkit_cuda_numba.attention import (
    block_sparse_attention,
    build_kernel_lut,
    dsd,
    sdd,
    softmax_backward,
    softmax_forward,
)

pytestmark = pytest.mark.usefixtures("sim")


def _dense(layout, block):
    return layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()


def _blocks(dense_mat, lut):
    """[BG, Hl*T, Hl*T]-free gather: the sparse blocks of a [BG, Hl, T, T] dense matrix."""
    b = lut.block
    out = [dense_mat[:, h, i * b:(i + 1) * b, j * b:(j + 1) * b]
           for h, i, j in zip(lut.nz_head.tolist(), lut.nz_row.tolist(), lut.nz_col.tolist())]
    return torch.stack(out, 1)


@pytest.mark.parametrize("block, dim, dtype", [(16, 20, torch.float32), (32, 8, torch.float16)])
def test_sdd_and_dsd(block, dim, dtype):
    layout = torch.tensor([[[1, 0], [1, 1]], [[0, 1], [1, 0]]])  # two layout heads
    lut = build_kernel_lut(layout, block)
    t = 2 * block
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1, 2 * t, dim, generator=gen).to(dtype) for _ in range(2))
    full = a.double().view(1, 2, t, dim) @ b.double().view(1, 2, t, dim).transpose(-1, -2)
    scores = sdd(a, b, lut)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(scores.double(), _blocks(full, lut), **tol)

    # DSD: blocks x dense, plain and transposed, against the masked dense product
    mask = _dense(layout, block)[None]
    sparse_dense = torch.where(mask, full, 0.0)
    out = dsd(scores, b, lut, transpose=False).view(1, 2, t, dim)
    torch.testing.assert_close(out.double(), sparse_dense @ b.double().view(1, 2, t, dim), **tol)
    out_t = dsd(scores, a, lut, transpose=True).view(1, 2, t, dim)
    torch.testing.assert_close(out_t.double(), sparse_dense.transpose(-1, -2) @ a.double().view(1, 2, t, dim), **tol)


def test_softmax_forward_backward_with_masks():
    block, t = 16, 32
    layout = torch.tensor([[[1, 0], [1, 1]]])
    lut = build_kernel_lut(layout, block)
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 1, t, t, generator=gen, dtype=torch.float64)
    kp = torch.zeros(2, t)
    kp[1, 20:] = float("-inf")
    am = torch.randn(t, t, generator=gen)
    scale = 0.3
    probs = _blocks(full, lut).float().contiguous()
    lse = softmax_forward(probs, lut, scale, 1, kp, am, causal=True)  # BG = batch 2 x 1 head

    s = full * scale + kp.double()[:, None, None, :] + am.double()
    s = s.masked_fill(~_dense(layout, block)[None] | torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1)
    torch.testing.assert_close(probs.double(), _blocks(ref, lut), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double().view(2, 1, t), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)

    grad_p = torch.randn(2, 1, t, t, generator=gen, dtype=torch.float64)
    dp = _blocks(grad_p, lut).float().contiguous()
    softmax_backward(probs, dp, lut, scale)
    ref_ds = scale * ref * (grad_p - (ref * grad_p).sum(-1, keepdim=True))
    torch.testing.assert_close(dp.double(), _blocks(ref_ds, lut), atol=1e-5, rtol=1e-5)


def test_attention_forward_backward_matches_reference():
    block, t, dim = 16, 32, 16
    layout = torch.tensor([[[1, 0], [1, 1]]])
    lut = build_kernel_lut(layout, block)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, t, dim, generator=gen, requires_grad=True) for _ in range(3))
    kp = torch.zeros(1, t)
    kp[0, 28:] = float("-inf")
    out = block_sparse_attention(q, k, v, lut, 1 / math.sqrt(dim), kp, None, causal=True)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)

    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(dim) + kp.double()[:, None, None, :]
    s = s.masked_fill(~_dense(layout, block)[None] | torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vd
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_unsupported_block_size_is_an_error():
    lut = build_kernel_lut(torch.ones(1, 2, 2), 8)
    x = torch.randn(1, 1, 16, 4)
    with pytest.raises(ValueError, match=r"support block sizes \(16, 32, 64\), got 8"):
        block_sparse_attention(x, x, x, lut, 0.5)


def test_lut_tables():
    layout = torch.tensor([[[1, 1, 0], [0, 1, 0], [1, 0, 1]]])
    lut = build_kernel_lut(layout, 16)
    assert lut.nz_row.tolist() == [0, 0, 1, 2, 2] and lut.nz_col.tolist() == [0, 1, 1, 0, 2]
    assert lut.row_ptr.tolist() == [0, 2, 3, 5]
    assert lut.col_ptr.tolist() == [0, 2, 4, 5]
    assert [lut.nz_col[n].item() for n in lut.col_nz.tolist()] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match=r"a layout must be \[heads, num_blocks, num_blocks\]"):
        build_kernel_lut(torch.ones(2, 3), 16)
