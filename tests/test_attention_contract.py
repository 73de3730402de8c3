"""The attention family's one contract, checked on every installed record: a factory takes the
model geometry (``causal``, ``dropout``, ``num_heads``, ``head_dim``, ``max_seq_length``) and the
module maps ``[batch, heads, seq, head_dim]`` query/key/value to the query's shape; a model that
names any of them by ``GPTConfig(attention=...)`` builds and runs."""
from __future__ import annotations

import pytest
import torch

from zkit.core.attention import available_attention, build_attention
from zkit.models.gpt import GPT, GPTConfig

GEOMETRY = {"causal": True, "dropout": 0.0, "num_heads": 4, "head_dim": 16, "max_seq_length": 64}


@pytest.mark.parametrize("name", available_attention())
def test_every_record_takes_the_geometry_and_the_calling_convention(name):
    module = build_attention(name, **GEOMETRY)
    q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    out = module(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("name", available_attention())
def test_a_gpt_runs_with_every_attention(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", attention=name, seq_len=64))
    logits = model(torch.randint(0, 256, (2, 64)))
    assert logits.shape == (2, 64, 256) and torch.isfinite(logits).all()


def test_an_option_no_implementation_takes_is_an_error():
    with pytest.raises(TypeError):
        build_attention("dense", **GEOMETRY, not_an_option=1)
