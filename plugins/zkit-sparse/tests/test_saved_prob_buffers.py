"""The saved-probability path: gradients in every dtype, and buffer reuse that never aliases."""
from __future__ import annotations

import pytest
import torch
from reference import dense_reference

from zkit_sparse import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
from zkit_sparse.reusable_buffer import ReusableBuffer, Workspace

H, T, D, BLK = 2, 128, 16, 16


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, D, dtype=torch.float64, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("save_probs", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_low_precision_gradients(save_probs, dtype, tol):
    attn = SparseSelfAttention(FixedSparsityConfig(H, block=BLK, num_local_blocks=2,
                                                   attention="unidirectional"),
                               max_seq_length=T, save_probs=save_probs)
    x64 = [x.requires_grad_() for x in _inputs()]
    ref = dense_reference(*x64, attn.layout(T), BLK, causal=True)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, x64, grad)
    xs = [x.detach().to(dtype).requires_grad_() for x in x64]
    out = attn(*xs)
    got = torch.autograd.grad(out, xs, grad.to(dtype))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=tol * 4, rtol=tol * 4)


def test_buffer_reused_when_free_and_fresh_when_referenced():
    cpu = torch.device("cpu")
    buf = ReusableBuffer()
    first = buf.take(100, torch.float32, cpu)
    busy = buf.take(50, torch.float32, cpu)  # `first` still holds the storage: a fresh buffer
    assert busy.data_ptr() != first.data_ptr()
    ptr = busy.data_ptr()
    del first, busy
    assert buf.take(50, torch.float32, cpu).data_ptr() == ptr  # free again: reused
    assert buf.take(20, torch.float32, cpu).data_ptr() == ptr  # smaller requests fit too
    alias = buf.take(20, torch.float32, cpu).detach()  # an alias made by a hook still counts
    assert buf.take(20, torch.float32, cpu).data_ptr() != alias.data_ptr()
    assert buf.take(10, torch.float64, cpu).dtype == torch.float64


def test_workspace_slots_do_not_overlap():
    ws = Workspace({"a": 6, "b": 4}, torch.float32, torch.device("cpu"))
    a, b = ws.get("a", (2, 3)), ws.get("b", (2, 2))
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.shape == (2, 3) and bool((a == 1).all()) and bool((b == 2).all())


def test_steps_reuse_the_probability_buffer():
    attn = SparseSelfAttention(BigBirdSparsityConfig(H, block=BLK, num_random_blocks=1),
                               max_seq_length=T)
    xs = [x.float().requires_grad_() for x in _inputs()]
    ptrs = []
    for _ in range(3):
        attn(*xs).sum().backward()
        ptrs.append(attn._prob_buffer._buf.data_ptr())
    assert ptrs[0] == ptrs[1] == ptrs[2]


def test_two_forwards_before_backward_and_retain_graph():
    """Graphs alive at once must not share probabilities (the buffer is busy: a fresh one)."""
    attn = SparseSelfAttention(BigBirdSparsityConfig(H, block=BLK, num_random_blocks=1),
                               max_seq_length=T)
    x1 = [x.requires_grad_() for x in _inputs(seed=1)]
    x2 = [x.requires_grad_() for x in _inputs(seed=2)]
    out1, out2 = attn(*x1), attn(*x2)
    layout = attn.layout(T)
    for xs, out in ((x1, out1), (x2, out2)):
        ref = dense_reference(*xs, layout, BLK)
        for _ in range(2):  # the second backward reuses the graph's saved probabilities
            got = torch.autograd.grad(out, xs, torch.ones_like(out), retain_graph=True)
            want = torch.autograd.grad(ref, xs, torch.ones_like(ref), retain_graph=True)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        attn(*xs).sum()  # a forward in between must not overwrite the live probabilities
