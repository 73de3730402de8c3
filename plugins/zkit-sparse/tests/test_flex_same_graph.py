"""zkit's flex backend runs what a hand-written FlexAttention call runs.

On the CPU, where FlexAttention's forward compiles, one shape is called through
``SparseSelfAttention(backend="flex", flex_compile=True)`` and through
``torch.compile(flex_attention)`` with a ``create_block_mask`` mask over the same token mask, both
compiled by inductor behind a graph-keeping backend. They compile one frame each, the same graph
(same operators, same ``kernel_options``, same scale, the same trivial ``score_mod``), recompile
nothing on later calls (nor for a second module), break no graph, and dispatch the same aten ops
per call outside the compiled graph (none, on this torch). Their ``BlockMask`` holds the same
partial and full tiles. The inputs are strided as the GPT hands them over (a permuted view of
the fused QKV projection), so a copy made per call would show.
"""
from __future__ import annotations

import operator

import pytest
import torch

from zkit.testing import CountingBackend, OpsOutsideCompiledGraphs
from zkit_sparse import BigBirdSparsityConfig, BSLongformerSparsityConfig, FixedSparsityConfig
from zkit_sparse import SparseSelfAttention, block_attention_flex
from zkit_sparse.flex_block_mask import layout_block_mask

flex = pytest.importorskip("torch.nn.attention.flex_attention")

# The GPU bench's geometry, small: 64-token layout blocks in 128-token FlexAttention tiles.
H, T, D, BLK, TILE = 2, 1024, 16, 64, 128
FIXED = dict(num_local_blocks=4, num_global_blocks=1, attention="unidirectional")


def graph_lines(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's operators and arguments with names made positional (input names differ:
    ``block_mask.mask_mod``'s closure in one, a global in the other), subgraphs inlined."""
    names: dict[str, str] = {}
    lines: list[str] = []
    for node in gm.graph.nodes:
        names[node.name] = f"v{len(names)}"
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: names[n.name])
        if node.op == "placeholder":
            lines.append(f"{names[node.name]} = input")
        elif node.op == "get_attr":
            lines.append(f"{names[node.name]} = subgraph")
            lines += ["  " + line for line in graph_lines(getattr(gm, node.target))]
        else:
            lines.append(f"{names[node.name]} = {node.op} {node.target} {args}")
    return lines


def gpt_strided_qkv(seed: int = 0):
    """q, k, v as zkit's GPT passes them: views of one [B, T, 3, H, D] projection."""
    qkv = torch.randn(1, T, 3, H, D, generator=torch.Generator().manual_seed(seed))
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def tiles(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tiles of a BlockMask as dense booleans, forward and backward lists."""
    def dense(num, idx):
        keep = torch.arange(idx.shape[-1]) < num[..., None]
        return torch.zeros(idx.shape, dtype=torch.bool).scatter_(-1, idx.long(), keep)
    return (dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices),
            dense(bm.q_num_blocks, bm.q_indices), dense(bm.full_q_num_blocks, bm.full_q_indices))


def hand_written_block_mask(layout: torch.Tensor, block: int, causal: bool, tile=TILE):
    lay = layout[0].bool()

    def token_mask(b, h, q_idx, kv_idx):
        keep = lay[q_idx // block, kv_idx // block]
        return keep & (q_idx >= kv_idx) if causal else keep

    return flex.create_block_mask(token_mask, 1, 1, layout.shape[-1] * block, layout.shape[-1] * block,
                                  device="cpu", BLOCK_SIZE=tile)


def test_flex_backend_runs_the_hand_written_graph_with_no_extra_ops(monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ours_backend, hand_backend = CountingBackend("inductor"), CountingBackend("inductor")
    # the process's compiled flex_attention, observed through a graph-keeping inductor backend
    monkeypatch.setitem(block_attention_flex._COMPILED, "inductor",
                        torch.compile(flex.flex_attention, dynamic=False, backend=ours_backend))
    cfg = FixedSparsityConfig(H, block=BLK, **FIXED)
    attn = SparseSelfAttention(cfg, max_seq_length=T, backend="flex", flex_compile=True)
    hand_bm = hand_written_block_mask(attn.layout(T), BLK, causal=True)
    hand = torch.compile(flex.flex_attention, dynamic=False, backend=hand_backend)
    q, k, v = gpt_strided_qkv()
    assert not q.is_contiguous()

    ops = {}
    with torch.no_grad():
        for name, call in (("hand", lambda: hand(q, k, v, block_mask=hand_bm)),
                           ("zkit", lambda: attn(q, k, v))):
            out = call()  # compiles
            for _ in range(2):
                call()
            with OpsOutsideCompiledGraphs() as mode:
                call()
            ops[name] = mode.ops
        torch.testing.assert_close(attn(q, k, v), out, rtol=0, atol=0)
        # another module of the same geometry (a second layer, a rebuilt model): same graph
        SparseSelfAttention(cfg, max_seq_length=T, backend="flex", flex_compile=True)(q, k, v)

    assert ours_backend.graphs == hand_backend.graphs == 1  # no recompilation
    ours, theirs = ours_backend.graph_modules[0], hand_backend.graph_modules[0]
    assert graph_lines(ours) == graph_lines(theirs)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert ops == {"hand": [], "zkit": []}
    hop = [n for n in ours.graph.nodes if n.op == "call_function"]
    assert [n.target for n in hop] == [torch.ops.higher_order.flex_attention, operator.getitem]
    scale, kernel_options = hop[0].args[5], hop[0].args[6]
    assert scale == D ** -0.5 and kernel_options["BACKEND"] == "AUTO"  # flex_attention's defaults
    for a, b in zip(tiles(attn.flex_block_mask(T, q.device)), tiles(hand_bm)):
        assert torch.equal(a, b)


def test_user_masks_add_only_their_padding_and_conversion():
    """With a key-padding mask the call adds a score_mod; outside the compiled graph that costs
    the mask's conversion to additive form and its padding to the tiles, nothing per block."""
    torch._dynamo.reset()
    cfg = FixedSparsityConfig(H, block=BLK, **FIXED)
    attn = SparseSelfAttention(cfg, max_seq_length=T, backend="flex", flex_compile=True,
                               key_padding_mask_mode="mul")
    q, k, v = gpt_strided_qkv()
    keep = torch.ones(1, T, dtype=torch.bool)
    keep[0, 900:] = False
    with torch.no_grad():
        attn(q, k, v, key_padding_mask=keep)
        with OpsOutsideCompiledGraphs() as mode:
            attn(q, k, v, key_padding_mask=keep)
    assert mode.ops == ["aten.zeros.default", "aten.bitwise_not.default", "aten.masked_fill_.Scalar"]


LAYOUTS_128 = {
    "fixed": lambda: FixedSparsityConfig(H, block=128, num_local_blocks=2, num_global_blocks=1,
                                         attention="unidirectional"),
    "bigbird": lambda: BigBirdSparsityConfig(H, block=128, num_sliding_window_blocks=3,
                                             num_random_blocks=1, num_global_blocks=1),
    "bslongformer": lambda: BSLongformerSparsityConfig(H, block=128, num_sliding_window_blocks=3,
                                                       global_block_indices=[0]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS_128))
def test_layout_blocks_of_a_tile_are_full_tiles_without_a_mask_function(name):
    """Layout blocks of FlexAttention's tile: every present block is a full tile (the kernel calls
    no mask_mod there); only the causal diagonal stays partial. Same tiles as create_block_mask."""
    cfg = LAYOUTS_128[name]()
    causal = getattr(cfg, "attention", "bidirectional") == "unidirectional"
    seq = 2048
    layout = cfg.make_layout(seq)
    ours = layout_block_mask(layout, 128, seq, causal, "cpu", TILE)
    partial, full = tiles(ours)[:2]
    present = layout[0].bool()
    if causal:
        assert torch.equal(partial[0, 0], torch.eye(seq // 128, dtype=torch.bool))
        assert torch.equal(full[0, 0], present.tril(-1))
    else:
        assert not partial.any() and torch.equal(full[0, 0], present)
    for a, b in zip(tiles(ours), tiles(hand_written_block_mask(layout, 128, causal))):
        assert torch.equal(a, b)
