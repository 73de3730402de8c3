"""SparseSelfAttention (PyTorch path) equals dense float64 attention with the same mask."""
from __future__ import annotations

import pytest
import torch
from reference import dense_reference

from zkit_sparse import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    pad_to_block_size,
)
from zkit_sparse.block_attention_recompute import RecomputeBlockSparseAttentionFn
from zkit_sparse.block_attention_torch import BlockSparseAttentionFn, MaskSpec
from zkit_sparse.block_lut import build_lut

H, T, D, BLK = 2, 128, 12, 16

LAYOUTS = {
    "dense": lambda att: DenseSparsityConfig(H, block=BLK),
    "fixed": lambda att: FixedSparsityConfig(H, block=BLK, num_local_blocks=2, attention=att),
    "fixed_per_head": lambda att: FixedSparsityConfig(
        H, block=BLK, num_local_blocks=2, attention=att, different_layout_per_head=True,
        num_different_global_patterns=2),
    "variable": lambda att: VariableSparsityConfig(H, block=BLK, num_random_blocks=1,
                                                   local_window_blocks=[1, 2], attention=att),
    "bigbird": lambda att: BigBirdSparsityConfig(H, block=BLK, num_random_blocks=1, attention=att,
                                                 different_layout_per_head=True),
    "bslongformer": lambda att: BSLongformerSparsityConfig(H, block=BLK, attention=att),
    "local": lambda att: LocalSlidingWindowSparsityConfig(H, block=BLK, attention=att),
}


def _inputs(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(3)]


def _check(attn, layout, causal, kp=None, am=None, kp_ref=None, am_ref=None):
    q, k, v = _inputs()
    out = attn(q, k, v, key_padding_mask=kp, attn_mask=am)
    ref = dense_reference(q, k, v, layout, BLK, causal, kp_ref, am_ref)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("save_probs", [True, False])
def test_matches_dense_reference_with_key_padding(name, causal, save_probs):
    cfg = LAYOUTS[name]("unidirectional" if causal else "bidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=T, causal=causal, workspace_elems=4096,
                               save_probs=save_probs)
    kp = torch.zeros(2, T, dtype=torch.float64)
    kp[0, 90:] = float("-inf")  # padded keys of the first sequence
    _check(attn, attn.layout(T), causal, kp=kp, kp_ref=kp)


@pytest.mark.parametrize("save_probs", [True, False])
def test_mul_masks_and_bool_masks(save_probs):
    cfg = BigBirdSparsityConfig(H, block=BLK, num_random_blocks=2)
    attn = SparseSelfAttention(cfg, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=T,
                               save_probs=save_probs)
    keep = torch.ones(2, T, dtype=torch.float64)
    keep[1, 100:] = 0
    am = (torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    am.fill_diagonal_(1)
    neg = lambda m: torch.zeros_like(m).masked_fill(m == 0, float("-inf"))  # noqa: E731
    _check(attn, attn.layout(T), False, kp=keep, am=am, kp_ref=neg(keep), am_ref=neg(am))
    _check(attn, attn.layout(T), False, kp=keep.bool(), am=am.bool(), kp_ref=neg(keep), am_ref=neg(am))


def test_additive_attn_mask():
    cfg = FixedSparsityConfig(H, block=BLK, num_local_blocks=4)
    attn = SparseSelfAttention(cfg, attn_mask_mode="add", max_seq_length=T)
    am = torch.randn(T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _check(attn, attn.layout(T), False, am=am, am_ref=am)


def test_shorter_sequence_uses_top_left_of_master_layout():
    cfg = BigBirdSparsityConfig(H, block=BLK, num_random_blocks=2)
    attn = SparseSelfAttention(cfg, max_seq_length=4 * T)
    assert torch.equal(attn.layout(T), attn.master_layout[:, : T // BLK, : T // BLK])
    _check(attn, attn.layout(T), False)


@pytest.mark.parametrize("save_probs", [True, False])
def test_fully_masked_rows_give_zero_not_nan(save_probs):
    attn = SparseSelfAttention(FixedSparsityConfig(H, block=BLK), max_seq_length=T, causal=True,
                               save_probs=save_probs)
    q, k, v = _inputs()
    kp = torch.zeros(2, T, dtype=torch.float64)
    kp[:, :40] = float("-inf")  # causal rows 0..39 see no key
    out = attn(q, k, v, key_padding_mask=kp)
    assert torch.isfinite(out).all() and out[:, :, :40].abs().max() == 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_dropout_train_vs_eval_and_gradcheck():
    cfg = FixedSparsityConfig(1, block=8, num_local_blocks=2)
    attn = SparseSelfAttention(cfg, max_seq_length=32, dropout=0.5)
    q, k, v = (torch.randn(1, 1, 32, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attn.eval()
    ref = dense_reference(q, k, v, attn.layout(32), 8)
    torch.testing.assert_close(attn(q, k, v), ref)
    attn.train()
    torch.manual_seed(0)
    a = attn(q, k, v)
    torch.manual_seed(0)
    assert torch.equal(a, attn(q, k, v)) and not torch.allclose(a, ref)
    # gradcheck at 2 x 2 blocks of 8 and head dim 2 (each input element is one forward pair)
    lut = build_lut(attn.layout(16), 8, causal=False)
    masks = MaskSpec(None, None, False)
    small = tuple(x.detach()[..., :16, :2].clone().requires_grad_() for x in (q, k, v))
    for cls in (BlockSparseAttentionFn, RecomputeBlockSparseAttentionFn):
        fn = lambda q, k, v: cls.apply(q, k, v, lut, masks, 0.5, 0.5, 1234, 64)  # noqa: E731
        assert torch.autograd.gradcheck(fn, small)


def test_float32_and_bfloat16_inputs():
    attn = SparseSelfAttention(FixedSparsityConfig(H, block=BLK), max_seq_length=T)
    q, k, v = (x.detach() for x in _inputs())
    ref = dense_reference(q, k, v, attn.layout(T), BLK)
    torch.testing.assert_close(attn(q.float(), k.float(), v.float()).double(), ref, atol=1e-5, rtol=1e-4)
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_work_is_proportional_to_nonzero_blocks():
    cfg = BigBirdSparsityConfig(4, block=16, num_random_blocks=2, num_global_blocks=1)
    layout = cfg.make_layout(1024)
    lut = build_lut(layout, 16, causal=False)
    assert lut.layout_heads == 1  # one layout shared by all heads: one gather serves all
    assert lut.padded_nnz() == lut.nnz  # no bucket overhead: one bucket per row length, no pads
    merged = build_lut(layout, 16, causal=False, bucket_overhead=1e9)
    assert len(merged.buckets) == 1 and merged.padded_nnz() > merged.nnz


def test_pad_to_block_size():
    x = torch.randn(1, 2, 70, 4)
    pad, padded = pad_to_block_size(16, x)
    assert pad == 10 and padded.shape == (1, 2, 80, 4) and torch.equal(padded[:, :, :70], x)
    assert pad_to_block_size(16, padded)[0] == 0


@pytest.mark.parametrize("call, message", [
    (lambda a, x: a(x[:, :, :120], x[:, :, :120], x[:, :, :120]), "sequence length 120 is not divisible by the block size 16"),
    (lambda a, x: a(*(torch.cat([x, x], 2),) * 3), "exceeds max_seq_length 128"),
    (lambda a, x: a(x[:, :1], x[:, :1], x[:, :1]), "query has 1 heads but the sparsity config was built for 2"),
    (lambda a, x: a(x, x, x, key_padding_mask=torch.zeros(2, 64)), "key_padding_mask must be [batch, seq] = (2, 128)"),
    (lambda a, x: a(x, x, x, attn_mask=torch.zeros(64, 64)), "attn_mask must be [seq, seq] = (128, 128)"),
    (lambda a, x: a(x[0], x[0], x[0]), "query must be [batch, heads, seq, head_dim]"),
    (lambda a, x: a(x, x[:, :, :64], x), "query, key and value shapes differ"),
])
def test_bad_calls_have_clear_errors(call, message):
    attn = SparseSelfAttention(FixedSparsityConfig(H, block=BLK), max_seq_length=T)
    x = torch.randn(2, H, T, D)
    with pytest.raises(ValueError) as info:
        call(attn, x)
    assert message in str(info.value)


def test_bad_constructor_arguments():
    cfg = FixedSparsityConfig(H, block=BLK)
    with pytest.raises(ValueError, match="key_padding_mask_mode must be 'add' or 'mul'"):
        SparseSelfAttention(cfg, key_padding_mask_mode="max")
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        SparseSelfAttention(cfg, dropout=1.0)
    with pytest.raises(TypeError, match="sparsity_config must be a zkit_sparse SparsityConfig"):
        SparseSelfAttention({"mode": "fixed"})
    with pytest.raises(ValueError, match="workspace_elems must be >= 1, got 0"):
        SparseSelfAttention(cfg, workspace_elems=0)
    with pytest.raises(RuntimeError, match=r"backend 'numba' \(use_kernels=True\) needs CUDA tensors; got tensors on cpu"):
        SparseSelfAttention(cfg, max_seq_length=T, use_kernels=True)(*(torch.randn(1, H, T, D),) * 3)
