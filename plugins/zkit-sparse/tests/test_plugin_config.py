"""The zkit plugin hooks, the sparse_attention section, the factory and the layout registry."""
from __future__ import annotations

import pytest
import torch

import zkit_sparse
from zkit_sparse import FixedSparsityConfig, SparseAttentionConfig, SparsityConfig, register_layout
from zkit_sparse import plugin


def test_records():
    (record,) = list(plugin.zkit_register_attention())
    assert record.name == "block_sparse" and record.aliases == ("sparse",)
    (section,) = list(plugin.zkit_config_sections())
    assert section.path == "sparse_attention" and section.schema is SparseAttentionConfig
    (topic, text), (backend_topic, _) = list(plugin.zkit_report())
    assert topic == "zkit-sparse" and "bigbird" in text
    assert backend_topic == "zkit-sparse backend"


def test_section_builds_deepspeed_layout():
    section = SparseAttentionConfig.from_dict({"mode": "fixed", "block": 32, "num_local_blocks": 8,
                                               "attention": "unidirectional"})
    cfg = section.to_sparsity_config(num_heads=4)
    assert isinstance(cfg, FixedSparsityConfig) and cfg.block == 32 and cfg.num_local_blocks == 8
    assert cfg.num_global_blocks == 1  # the mode's default


def test_section_errors():
    with pytest.raises(ValueError, match="unknown key 'num_local_block'; did you mean 'num_local_blocks'"):
        SparseAttentionConfig.from_dict({"mode": "fixed", "num_local_block": 4})
    with pytest.raises(ValueError, match="num_random_blocks not used by mode 'fixed'"):
        SparseAttentionConfig(mode="fixed", num_random_blocks=2).to_sparsity_config(2)
    with pytest.raises(ValueError, match="unknown sparse attention layout 'bigbrid'; did you mean 'bigbird'"):
        SparseAttentionConfig(mode="bigbrid").to_sparsity_config(2)


def test_factory_matches_dense_call_signature_and_defaults_to_causal():
    (record,) = list(plugin.zkit_register_attention())
    attn = record.factory(num_heads=2, mode="bslongformer", block=16, max_seq_length=64, dropout=0.1)
    assert attn.causal and attn.dropout == 0.1
    q = torch.randn(1, 2, 64, 8)
    assert attn(q, q, q, key_padding_mask=None, attn_mask=None).shape == q.shape
    attn2 = record.factory(sparse_attention={"mode": "bigbird", "block": 16}, num_heads=2,
                           max_seq_length=64, causal=False)
    assert not attn2.causal
    attn3 = record.factory(sparsity_config=FixedSparsityConfig(2, block=16), max_seq_length=64)
    assert attn3.sparsity_config.block == 16


def test_factory_errors():
    (record,) = list(plugin.zkit_register_attention())
    with pytest.raises(ValueError, match="needs num_heads"):
        record.factory(mode="fixed")
    with pytest.raises(ValueError, match="give the layout once"):
        record.factory(sparsity_config=FixedSparsityConfig(2), mode="fixed")
    with pytest.raises(ValueError, match="num_heads=3 but the sparsity config has 2"):
        record.factory(sparsity_config=FixedSparsityConfig(2), num_heads=3)


class DiagonalSparsityConfig(SparsityConfig):
    """A third-party layout: each block attends to itself only."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, width=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.width = width

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        layout[:] = torch.eye(layout.shape[1], dtype=layout.dtype)
        return layout


def test_third_party_layout_registry():
    register_layout("diagonal_test", DiagonalSparsityConfig)
    assert "diagonal_test" in zkit_sparse.available_layouts()
    cfg = SparseAttentionConfig(mode="diagonal_test", block=16, params={"width": 2}).to_sparsity_config(2)
    assert isinstance(cfg, DiagonalSparsityConfig) and cfg.width == 2
    with pytest.raises(ValueError, match="already registered"):
        register_layout("diagonal_test", FixedSparsityConfig)
    with pytest.raises(TypeError, match="must be a SparsityConfig subclass"):
        register_layout("bad", dict)
