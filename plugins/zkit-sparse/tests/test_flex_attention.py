"""The FlexAttention backend on the CPU: its BlockMask equals the one FlexAttention derives from
the token-level mask, its forward equals the dense masked reference, and it compiles once.

FlexAttention has no CPU backward, so gradients are checked on a GPU
(``contrib/bench/bench_sparse_attention.py --gpu``); everything that builds the mask is here.
"""
from __future__ import annotations

import pytest
import torch
from reference import dense_reference
from test_sparse_attention import LAYOUTS

from zkit_sparse import FixedSparsityConfig, SparseSelfAttention, SparsityConfig, register_layout
from zkit_sparse import backends
from zkit_sparse.block_attention_flex import flex_block_sparse_attention
from zkit_sparse.factory import make_block_sparse_attention
from zkit_sparse.flex_block_mask import layout_block_mask

flex = pytest.importorskip("torch.nn.attention.flex_attention")

H, D, BLK = 2, 12, 16


def _tiles(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tiles of a BlockMask as dense [B, H, nQ, nK] booleans."""
    def dense(num, idx):
        out = torch.zeros(idx.shape, dtype=torch.bool)
        keep = torch.arange(idx.shape[-1]) < num[..., None]
        return out.scatter_(-1, idx.long(), keep)
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq, tile", [(128, 32), (176, 32), (192, (64, 32))])
def test_block_mask_equals_flex_token_level_mask(name, causal, seq, tile):
    layout = LAYOUTS[name]("unidirectional" if causal else "bidirectional").make_layout(seq)
    ours = layout_block_mask(layout, BLK, seq, causal, "cpu", tile)
    heads = ours.kv_num_blocks.shape[1]
    present = layout[:heads].bool().repeat_interleave(BLK, 1).repeat_interleave(BLK, 2)

    def token_mask(b, h, q, kv):
        return present[h, q, kv] & ((q >= kv) | (not causal))

    theirs = flex.create_block_mask(token_mask, 1, heads, seq, seq, device="cpu", BLOCK_SIZE=tile)
    for a, b in zip(_tiles(ours), _tiles(theirs)):
        assert torch.equal(a, b)
    assert ours.seq_lengths == (seq, seq)


def _inputs(batch=2, seq=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, seq, D, dtype=torch.float64, generator=gen) for _ in range(3)]


def _flex_module(cfg, causal, seq=128, **kwargs):
    return SparseSelfAttention(cfg, max_seq_length=seq, causal=causal, backend="flex",
                               flex_block_size=32, **kwargs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_dense_reference_with_key_padding(name, causal):
    attn = _flex_module(LAYOUTS[name]("unidirectional" if causal else "bidirectional"), causal)
    q, k, v = _inputs()
    kp = torch.zeros(2, 128, dtype=torch.float64)
    kp[0, 90:] = float("-inf")
    kp[1, :5] = -3.0  # a finite additive bias, not only masking
    out = attn(q, k, v, key_padding_mask=kp)
    assert attn.backend_for(q) == "flex"
    ref = dense_reference(q, k, v, attn.layout(128), BLK, causal, kp)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_forward_mul_add_and_bool_masks_and_a_fully_masked_row():
    cfg = LAYOUTS["bigbird"]("bidirectional")
    q, k, v = _inputs()
    keep = torch.ones(2, 128, dtype=torch.float64)
    keep[1, 100:] = 0
    am = (torch.rand(128, 128, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    am.fill_diagonal_(1)
    am[7] = 0  # query 7 sees no key: its output is zero, not NaN
    neg = lambda m: torch.zeros_like(m).masked_fill(m == 0, float("-inf"))  # noqa: E731
    mul = _flex_module(cfg, False, key_padding_mask_mode="mul", attn_mask_mode="mul")
    ref = dense_reference(q, k, v, mul.layout(128), BLK, False, neg(keep), neg(am))
    for kp_, am_ in ((keep, am), (keep.bool(), am.bool())):
        out = mul(q, k, v, key_padding_mask=kp_, attn_mask=am_)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert out[:, :, 7].abs().max() == 0
    bias = torch.randn(128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    add = _flex_module(cfg, True, key_padding_mask_mode="add", attn_mask_mode="add")
    out = add(q, k, v, key_padding_mask=neg(keep), attn_mask=bias)
    ref = dense_reference(q, k, v, add.layout(128), BLK, True, neg(keep), bias)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_tiles_past_the_sequence_and_per_head_layouts():
    # 176 tokens: the last 32-token tile ends past the sequence; the masks are padded for it.
    cfg = LAYOUTS["fixed_per_head"]("unidirectional")
    attn = _flex_module(cfg, True, seq=176)
    q, k, v = _inputs(seq=176)
    kp = torch.zeros(2, 176, dtype=torch.float64)
    kp[0, 150:] = float("-inf")
    am = torch.randn(176, 176, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    attn.attn_mask_mode = "add"
    out = attn(q, k, v, key_padding_mask=kp, attn_mask=am)
    ref = dense_reference(q, k, v, attn.layout(176), BLK, True, kp, am)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert attn.flex_block_mask(176, q.device).kv_num_blocks.shape[1] == H  # per-head mask


class _Strided(SparsityConfig):
    """A user layout: every third key block, and the diagonal."""

    def make_layout(self, seq_len):
        nb = seq_len // self.block
        layout = torch.zeros(self.num_heads, nb, nb, dtype=torch.int64)
        layout[:, :, ::3] = 1
        layout[:, range(nb), range(nb)] = 1
        return layout


def test_registered_user_layout():
    register_layout("strided_flex_test", _Strided, replace=True)
    attn = make_block_sparse_attention(mode="strided_flex_test", block=BLK, num_heads=H,
                                       max_seq_length=128, causal=False, backend="flex",
                                       flex_block_size=32)
    q, k, v = _inputs()
    ref = dense_reference(q, k, v, attn.layout(128), BLK, False)
    torch.testing.assert_close(attn(q, k, v), ref, rtol=1e-10, atol=1e-10)


def test_compiles_once_per_shape_and_caches_the_block_mask():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    q, k, v = (x.float() for x in _inputs())
    modules = [_flex_module(LAYOUTS[name]("unidirectional"), True) for name in ("fixed", "local")]
    for attn in modules:
        bm = attn.flex_block_mask(128, q.device)
        assert attn.flex_block_mask(128, q.device) is bm
        for seed in range(3):  # new mask values: graph inputs, no recompilation
            kp = torch.randn(2, 128, generator=torch.Generator().manual_seed(seed))
            out = flex_block_sparse_attention(q, k, v, bm, D**-0.5, kp, compile_backend=counter)
            ref = dense_reference(q, k, v, attn.layout(128), BLK, True, kp) if seed == 0 else None
            if ref is not None:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_bad_flex_options_are_refused():
    cfg = FixedSparsityConfig(H, block=BLK)
    with pytest.raises(ValueError, match=r"backend='flex' cannot apply dropout=0.1: FlexAttention has no"):
        SparseSelfAttention(cfg, backend="flex", dropout=0.1)
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'flex', 'numba', 'torch'; got 'triton'"):
        SparseSelfAttention(cfg, backend="triton")
    with pytest.raises(ValueError, match=r"give use_kernels=True or backend='flex', not both"):
        SparseSelfAttention(cfg, backend="flex", use_kernels=True)
    with pytest.raises(ValueError, match=r"flex_block_size must be a power of two >= 16 or a pair of them, got 96"):
        SparseSelfAttention(cfg, flex_block_size=96)
    with pytest.raises(ValueError, match=r"backend='flex' cannot apply dropout"):  # through the factory
        make_block_sparse_attention(mode="fixed", num_heads=H, dropout=0.2, backend="flex")
    with pytest.raises(ValueError, match=r"flex_compile must be True, False or None, got 1"):
        SparseSelfAttention(cfg, backend="flex", flex_compile=1)
    with pytest.raises(ValueError, match=r"flex_compile must be True, False or None, got 'yes'"):
        make_block_sparse_attention(mode="fixed", num_heads=H, backend="flex", flex_compile="yes")
    q = torch.randn(1, H, 128, D, requires_grad=True)
    for compiled in (None, True):  # refused before compiling, which raises NotImplementedError
        with pytest.raises(RuntimeError, match="backend 'flex' on the CPU runs the forward only"):
            _flex_module(LAYOUTS["fixed"]("bidirectional"), False, flex_compile=compiled)(q, q, q)
    with torch.no_grad():  # inference on the CPU works
        _flex_module(LAYOUTS["fixed"]("bidirectional"), False)(q, q, q)


def test_auto_backend_order(monkeypatch):
    assert backends.auto_backend("cpu", torch.float32, 0.0, 64, 4096, 0.15) == "torch"
    monkeypatch.setattr(backends, "flex_unavailable_reason", lambda device_type="cuda": None)
    monkeypatch.setattr(backends, "numba_unavailable_reason", lambda block: None)
    assert backends.auto_backend("cuda", torch.bfloat16, 0.0, 64, 4096, 0.15) == "flex"
    assert backends.auto_backend("cuda", torch.bfloat16, 0.1, 64, 4096, 0.15) == "numba"  # flex has no dropout
    assert backends.auto_backend("cuda", torch.float64, 0.0, 64, 4096, 0.15) == "torch"  # no fp64 kernels
    monkeypatch.setattr(backends, "numba_unavailable_reason", lambda block: "not installed")
    assert backends.auto_backend("cuda", torch.float16, 0.1, 64, 4096, 0.15) == "torch"
    assert backends.describe().startswith(
        "backend auto for CUDA tensors (no CUDA device here) (fastest usable in the measured GPU "
        "table): flex at fixed 4096, flex at fixed 16384")


def test_report_names_the_backend():
    from zkit_sparse.plugin import zkit_report

    lines = dict(zkit_report())
    assert lines["zkit-sparse backend"].startswith("backend auto for CUDA tensors")
    assert "force one with backend='flex' | 'numba' | 'torch'" in lines["zkit-sparse backend"]
