"""The FlexAttention call path: tiles its backward cannot lower are refused before compiling,
and a repeated call does no per-call work over the layout on the host."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from zkit_sparse import FixedSparsityConfig, SparseSelfAttention
from zkit_sparse import block_attention_flex, flex_backward_tiles
from zkit_sparse.flex_backward_tiles import backward_tile_problem, check_backward_tile
from zkit_sparse.flex_block_mask import layout_block_mask

pytest.importorskip("torch.nn.attention.flex_attention")

#: inductor's one backward config for an H100 (capability 9.0), head_dim 64, bf16, outside max-autotune
SM90_D64 = [(64, 128, 128, 64)]


def test_h100_backward_refuses_a_64_token_key_tile_with_the_reason():
    msg = backward_tile_problem((128, 64), 64, torch.bfloat16, SM90_D64)
    assert "flex_block_size (128, 64) cannot run FlexAttention's backward" in msg
    assert "(64, 128, 128, 64): query tile a multiple of 128, key tile a multiple of 128" in msg
    assert "Use flex_block_size=128" in msg and "torch.no_grad()" in msg
    assert backward_tile_problem((128, 128), 64, torch.bfloat16, SM90_D64) is None
    assert backward_tile_problem((256, 128), 64, torch.bfloat16, SM90_D64) is None
    assert backward_tile_problem((64, 64), 64, torch.bfloat16, [(64, 64, 64, 64)]) is None
    # a torch that does not expose its configs: nothing refused up front
    assert backward_tile_problem((128, 64), 64, torch.bfloat16, None) is None


def test_torch_heuristic_for_an_h100_gives_the_refusal(monkeypatch):
    # inductor's own heuristic, asked as on an H100: the configs the lowering would filter
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    configs = flex_backward_tiles.inductor_backward_tiles(64, torch.bfloat16)
    if configs is None:
        pytest.skip("this torch does not expose inductor's FlexAttention backward configs")
    assert backward_tile_problem((128, 128), 64, torch.bfloat16, configs) is None
    assert backward_tile_problem((128, 64), 64, torch.bfloat16, configs) is not None


def test_check_is_asked_once_and_raises_value_error():
    calls = []

    def configs_of(head_dim, dtype):
        calls.append((head_dim, dtype))
        return SM90_D64

    for _ in range(2):
        with pytest.raises(ValueError, match=r"flex_block_size \(128, 64\) cannot run"):
            check_backward_tile((128, 64), 64, torch.bfloat16, torch.device("cuda", 0), configs_of)
    check_backward_tile((128, 128), 64, torch.bfloat16, torch.device("cuda", 0), configs_of)
    assert calls == [(64, torch.bfloat16)] * 2


def test_training_call_on_cuda_tensors_is_checked_before_compiling(monkeypatch):
    """The call path asks before it reaches flex_attention (CUDA simulated: the check needs
    only the tensors' metadata)."""
    seen = []

    def refuse(tile, head_dim, dtype, device):
        seen.append((tile, head_dim, dtype))
        raise ValueError("refused")

    monkeypatch.setattr(block_attention_flex, "check_backward_tile", refuse)
    monkeypatch.setattr(block_attention_flex, "_flex_attention",
                        lambda backend: pytest.fail("flex_attention reached before the check"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    layout = FixedSparsityConfig(2, block=16, num_local_blocks=2, attention="unidirectional").make_layout(64)
    bm = layout_block_mask(layout, 16, 64, True, "cpu", (32, 16))
    q = torch.randn(1, 2, 64, 8, requires_grad=True)
    with pytest.raises(ValueError, match="refused"):
        block_attention_flex.flex_block_sparse_attention(q, q, q, bm, 0.3)
    assert seen == [((32, 16), 8, torch.float32)]


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["flex", "torch"])
def test_repeated_call_does_not_reduce_the_layout_again(monkeypatch, backend):
    cfg = FixedSparsityConfig(2, block=16, num_local_blocks=2, attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=64, backend=backend, flex_block_size=32)
    # the kernels are not what is counted here
    monkeypatch.setattr(block_attention_flex, "_flex_attention", lambda backend: lambda q, *a, **k: q)
    import zkit_sparse.attention as attention
    monkeypatch.setattr(attention, "block_sparse_attention", lambda q, *a, **k: q)
    q = torch.randn(1, 2, 64, 8)
    with torch.no_grad():
        attn(q, q, q)
        with _Calls() as calls:
            attn(q, q, q)
    assert "all" not in calls.names, calls.names


BENCH_FIXED = dict(num_local_blocks=4, num_global_blocks=1, attention="unidirectional")


def _tiles(bm):
    def dense(num, idx):
        keep = torch.arange(idx.shape[-1]) < num[..., None]
        return torch.zeros(idx.shape, dtype=torch.bool).scatter_(-1, idx.long(), keep)
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize("tile", [128, (128, 64)])
def test_bench_geometry_block_mask_equals_create_block_mask(tile):
    """64-token blocks in FlexAttention tiles, as on the GPU: partial and full tiles both equal
    what create_block_mask finds from the token-level mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    seq = 1024
    layout = FixedSparsityConfig(4, block=64, **BENCH_FIXED).make_layout(seq)
    ours = layout_block_mask(layout, 64, seq, True, "cpu", tile)
    lay = layout[0].bool()

    def mask_mod(b, h, q, kv):
        return lay[q // 64, kv // 64] & (q >= kv)

    theirs = create_block_mask(mask_mod, 1, 1, seq, seq, device="cpu", BLOCK_SIZE=tile)
    for a, b in zip(_tiles(ours), _tiles(theirs)):
        assert torch.equal(a, b)
    assert int(ours.full_kv_num_blocks.sum()) > 0


def test_bench_fixed_layout_tile_fractions():
    # the figures quoted in zkit_sparse.flex_block_mask's docstring
    seq = 16384
    layout = FixedSparsityConfig(16, block=64, **BENCH_FIXED).make_layout(seq)
    got = {}
    for tile in (128, (128, 64)):
        bm = layout_block_mask(layout, 64, seq, True, "cpu", tile)
        total = (seq // bm.BLOCK_SIZE[0]) * (seq // bm.BLOCK_SIZE[1])
        got[tile] = (round(int(bm.kv_num_blocks.sum()) / total, 3),
                     round(int(bm.full_kv_num_blocks.sum()) / total, 3))
    assert got == {128: (0.254, 0.004), (128, 64): (0.008, 0.127)}


@pytest.mark.parametrize("with_masks", [False, True])
def test_compiled_call_is_one_graph_without_breaks(with_masks):
    """Everything of the call (BlockMask, mask_mod, score_mod) is traced into one graph: nothing
    falls back to eager FlexAttention, which would materialise the scores."""
    layout = FixedSparsityConfig(2, block=16, **BENCH_FIXED).make_layout(128)
    bm = layout_block_mask(layout, 16, 128, True, "cpu", 32)
    q, k, v = (torch.randn(1, 2, 128, 8) for _ in range(3))
    kp = torch.zeros(1, 128) if with_masks else None
    am = torch.zeros(128, 128) if with_masks else None
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = block_attention_flex.mask_score_mod(kp, am, 128)
    with torch.no_grad():
        explained = torch._dynamo.explain(flex_attention)(q, k, v, score_mod=score_mod,
                                                          block_mask=bm, scale=0.3)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_input_checks_run_again_only_when_shapes_change(monkeypatch):
    """The checks depend on the shapes only: a repeated call does not redo them, a new shape
    (a bad one included) does."""
    cfg = FixedSparsityConfig(2, block=16, num_local_blocks=2, attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=64, backend="torch")
    import zkit_sparse.attention as attention
    monkeypatch.setattr(attention, "block_sparse_attention", lambda q, *a, **k: q)
    checked = []
    real_check = attn._check
    monkeypatch.setattr(attn, "_check", lambda *a: checked.append(a[0].shape) or real_check(*a))
    q = torch.randn(1, 2, 64, 8)
    for _ in range(3):
        attn(q, q, q)
    attn(q[:, :, :32], q[:, :, :32], q[:, :, :32])
    assert checked == [q.shape, torch.Size([1, 2, 32, 8])]
    with pytest.raises(ValueError, match="query, key and value shapes differ"):
        attn(q, q[:, :, :32], q)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, seq\] = \(1, 64\), got \(1, 32\)"):
        attn(q, q, q, key_padding_mask=torch.zeros(1, 32))
