"""On a CUDA machine: the kernels through SparseSelfAttention equal the PyTorch path."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_kernels_match_torch_path(dtype, block):
    from zkit_sparse import BigBirdSparsityConfig, SparseSelfAttention

    cfg = BigBirdSparsityConfig(4, block=block, num_random_blocks=2)
    kernel = SparseSelfAttention(cfg, max_seq_length=1024, use_kernels=True)
    torch_path = SparseSelfAttention(cfg, max_seq_length=1024, use_kernels=False)
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    kp = torch.zeros(2, 1024, device="cuda")
    kp[1, 900:] = float("-inf")
    out = kernel(q, k, v, key_padding_mask=kp)
    ref = torch_path(q, k, v, key_padding_mask=kp)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a.float(), b.float(), atol=10 * tol, rtol=10 * tol)


def test_fused_adam_matches_torch_on_gpu():
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    p = torch.randn(1 << 20, device="cuda", requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt, ref = FusedAdamCUDA([p], lr=1e-3, weight_decay=0.01), torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
