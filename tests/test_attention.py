"""Dense attention against a float64 softmax(QKᵀ/√d + mask)V reference, mask conventions, errors."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.core.attention import available_attention, build_attention
from zkit.models.dense_attention import DenseAttention
from zkit.core.plugin_manager import PluginError


def reference(q, k, v, keep=None, bias=None):
    """softmax(QKᵀ/√d + bias) V in float64, dropped pairs (keep False) excluded; rows with no key
    left give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.double()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    dead = torch.isneginf(scores).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return weights @ v


def causal_keep(seq_q, seq_k):
    return torch.ones(seq_q, seq_k, dtype=torch.bool).tril(seq_k - seq_q)


def qkv(batch=2, heads=3, seq_q=7, seq_k=7, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, heads, seq_k, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, heads, seq_k, dim, generator=g, dtype=dtype)
    return q, k, v


def test_causal_matches_reference():
    q, k, v = qkv()
    out = DenseAttention(causal=True)(q, k, v)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep=causal_keep(7, 7)), atol=1e-5, rtol=1e-5)


def test_non_causal_float64_exact():
    q, k, v = qkv(dtype=torch.float64)
    out = DenseAttention(causal=False)(q, k, v)
    torch.testing.assert_close(out, reference(q, k, v), atol=1e-12, rtol=1e-12)


def test_causal_with_fewer_queries_is_bottom_right_aligned():
    q, k, v = qkv(seq_q=3, seq_k=9, dtype=torch.float64)
    out = DenseAttention(causal=True)(q, k, v)
    torch.testing.assert_close(out, reference(q, k, v, keep=causal_keep(3, 9)), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", ["add", "mul", "bool"])
def test_key_padding_mask_modes(mode):
    q, k, v = qkv(dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    keep[1, 2] = False
    if mode == "add":
        mask = torch.zeros(2, 7, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    elif mode == "mul":
        mask = keep.double()
    else:
        mask = keep
    attn = DenseAttention(causal=True, key_padding_mask_mode="mul" if mode == "mul" else "add")
    expected = reference(q, k, v, keep=causal_keep(7, 7) & keep[:, None, None, :])
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=mask), expected, atol=1e-12, rtol=1e-12)


def test_extended_key_padding_mask_and_additive_bias_values():
    # BERT-style [batch, 1, 1, seq] additive mask with finite values is added, not thresholded.
    q, k, v = qkv(dtype=torch.float64)
    mask = torch.randn(2, 1, 1, 7, dtype=torch.float64)
    out = DenseAttention(causal=False)(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, reference(q, k, v, bias=mask), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", ["mul", "add"])
def test_attn_mask_modes_with_causal(mode):
    q, k, v = qkv(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(7, 7, generator=g) > 0.3
    mask = keep.double() if mode == "mul" else torch.zeros(7, 7, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out = DenseAttention(causal=True, attn_mask_mode=mode)(q, k, v, attn_mask=mask)
    expected = reference(q, k, v, keep=keep & causal_keep(7, 7))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in qkv())
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 0] = False  # with causal masking, query 0 of batch 0 has no key left
    out = DenseAttention(causal=True)(q, k, v, key_padding_mask=keep)
    assert torch.all(out[0, :, 0] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    expected = reference(q, k, v, keep=causal_keep(7, 7) & keep[:, None, None, :])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_gradients_match_reference():
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float64))
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 4:] = False
    weights = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    (DenseAttention(causal=True)(q, k, v, key_padding_mask=keep) * weights).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (reference(q, k, v, keep=causal_keep(7, 7) & keep[:, None, None, :]) * weights).sum().backward()
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-10, rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    seq_q=st.integers(1, 9),
    extra_keys=st.integers(0, 4),
    dim=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    use_kpm=st.booleans(),
    use_attn_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(batch, heads, seq_q, extra_keys, dim, causal, use_kpm, use_attn_mask, seed):
    seq_k = seq_q + extra_keys
    q, k, v = qkv(batch, heads, seq_q, seq_k, dim, dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    keep = torch.ones(batch, heads, seq_q, seq_k, dtype=torch.bool)
    kpm = attn_mask = None
    if use_kpm:
        kpm = torch.rand(batch, seq_k, generator=g) > 0.3
        keep &= kpm[:, None, None, :]
    if use_attn_mask:
        attn_mask = torch.rand(seq_q, seq_k, generator=g) > 0.3
        keep &= attn_mask
    if causal:
        keep &= causal_keep(seq_q, seq_k)
    out = DenseAttention(causal=causal)(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)
    torch.testing.assert_close(out, reference(q, k, v, keep=keep), atol=1e-10, rtol=1e-10)


def test_dropout_only_in_training():
    q, k, v = qkv()
    attn = DenseAttention(causal=True, dropout=0.5)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v), DenseAttention(causal=True)(q, k, v))
    attn.train()
    torch.manual_seed(0)
    assert not torch.allclose(attn(q, k, v), DenseAttention(causal=True)(q, k, v))


def test_build_attention_by_name_and_alias():
    assert "dense" in available_attention()
    for name in ("dense", "Dense", "full"):
        module = build_attention(name, causal=False, num_heads=3, head_dim=8)
        assert isinstance(module, DenseAttention) and module.causal is False


def test_unknown_attention_name_lists_valid_and_provider():
    with pytest.raises(PluginError, match=r"unknown attention 'nope'; valid attention names: .*dense"):
        build_attention("nope")
    try:
        import zkit_sparse  # noqa: F401
    except ImportError:
        with pytest.raises(PluginError, match=r"provided by the distribution 'zkit-sparse': pip install zkit-sparse"):
            build_attention("block_sparse")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"sparsity_config": 1}, TypeError, "dense attention does not take option\\(s\\) sparsity_config"),
        ({"dropout": 1.0}, ValueError, r"attention dropout must be in \[0, 1\), got 1.0"),
        ({"key_padding_mask_mode": "or"}, ValueError, "key_padding_mask_mode must be 'add' or 'mul', got 'or'"),
        ({"attn_mask_mode": None}, ValueError, "attn_mask_mode must be 'add' or 'mul', got None"),
        ({"num_heads": 0}, ValueError, "num_heads must be a positive integer, got 0"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        DenseAttention(**kwargs)


def test_bad_inputs():
    q, k, v = qkv()
    attn = DenseAttention(causal=True, num_heads=3, head_dim=8, max_seq_length=8)
    with pytest.raises(ValueError, match=r"attention query must be \[batch, heads, seq, head_dim\], got shape \(2, 7, 8\)"):
        attn(q[:, 0], k, v)
    with pytest.raises(ValueError, match="query, key and value disagree"):
        attn(q, k[:, :, :5], v)
    with pytest.raises(ValueError, match="attention built for 3 heads got 2"):
        attn(q[:, :2], k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="attention built for head_dim 8 got 4"):
        attn(q[..., :4], k[..., :4], v)
    with pytest.raises(ValueError, match="exceeds the max_seq_length 8"):
        attn(*qkv(seq_q=9, seq_k=9))
    with pytest.raises(ValueError, match="causal attention needs at least as many keys as queries"):
        attn(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, seq_k\] = \[2, 7\], got \(7,\)"):
        attn(q, k, v, key_padding_mask=torch.ones(7))
    with pytest.raises(ValueError, match=r"attn_mask must be \[seq_q, seq_k\] = \[7, 7\]"):
        attn(q, k, v, attn_mask=torch.ones(7, 6))
