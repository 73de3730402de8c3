"""A small GPT built from the tensor-parallel layers: vocab-parallel embedding tied to the LM head,
attention with heads split over the tensor group, a column/row-parallel MLP and vocab-parallel
cross-entropy. With ``comm=None`` it is an ordinary dense GPT with the very same initial weights,
which is how tests and benchmarks check the parallel versions against it.

Dropout on the replicated residual stream uses the default generator (seeded equally over the
tensor group); dropout on a rank's own attention heads uses the tensor-parallel RNG state (see
:mod:`zkit_pipeline.tensor_parallel.rng_tracker`).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from zkit_pipeline.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_group,
    get_rng_tracker,
    vocab_parallel_cross_entropy,
)


@attrs.frozen(kw_only=True)
class TensorParallelGPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0
    seed: int = 1234


def _tp(comm: Any) -> int:
    return 1 if comm is None else comm.world_size


class ParallelAttention(nn.Module):
    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any, seed: int) -> None:
        super().__init__()
        if cfg.n_heads % _tp(comm):
            raise ValueError(f"n_heads ({cfg.n_heads}) must be divisible by the tensor-parallel size ({_tp(comm)})")
        self.heads = cfg.n_heads // _tp(comm)
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        # q, k and v as three column layers so each rank holds whole heads of each.
        self.q, self.k, self.v = (ColumnParallelLinear(cfg.d_model, cfg.d_model, comm, seed=seed + i) for i in range(3))
        self.out = RowParallelLinear(cfg.d_model, cfg.d_model, comm, seed=seed + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if self.training and self.dropout > 0:
            with get_rng_tracker().fork():  # this rank's heads: a mask of their own
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any, seed: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.d_model, 4 * cfg.d_model, comm, seed=seed)
        self.fc2 = RowParallelLinear(4 * cfg.d_model, cfg.d_model, comm, seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TensorParallelBlock(nn.Module):
    """Pre-norm transformer block; its input and output are replicated over the tensor group."""

    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any, index: int) -> None:
        super().__init__()
        seed = cfg.seed + 100 * (index + 1)
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = ParallelAttention(cfg, comm, seed)
        self.mlp = ParallelMLP(cfg, comm, seed + 10)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    """Token (vocab-parallel) plus position embeddings."""

    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any) -> None:
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, comm, seed=cfg.seed)
        self.positions = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model, device="cpu"))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tokens(ids) + self.positions[: ids.shape[1]])


class LMHead(nn.Module):
    """Final norm and vocab-parallel logits, using the embedding's weight slice (tied)."""

    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any, embedding: VocabParallelEmbedding) -> None:
        super().__init__()
        self.comm = comm
        self.ln = nn.LayerNorm(cfg.d_model)
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(self.ln(x), self.comm), self.embedding.weight)


class TensorParallelGPT(nn.Module):
    """``model(ids)`` returns vocab-parallel logits; ``model.loss(logits, targets)`` the mean loss."""

    def __init__(self, cfg: TensorParallelGPTConfig, comm: Any = None) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
        self.cfg, self.comm = cfg, comm
        self.embed = Embedding(cfg, comm)
        self.blocks = nn.ModuleList(TensorParallelBlock(cfg, comm, i) for i in range(cfg.n_layers))
        self.head = LMHead(cfg, comm, self.embed.tokens)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm).mean()


def _tied_logits(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The LM head of :func:`pipeline_layers`: logits from the tied token embedding."""
    return F.linear(copy_to_group(x, embedding.tokens.comm), embedding.tokens.weight)


def pipeline_layers(cfg: TensorParallelGPTConfig, comm: Any = None) -> list[Any]:
    """The same GPT as a layer list for :class:`~zkit_pipeline.PipelineModule`: the embedding
    (tokens and positions) is a :class:`~zkit_pipeline.TiedLayerSpec` that the LM head on the last
    stage uses again, so it starts from the same weights as ``TensorParallelGPT(cfg)``."""
    from zkit_pipeline.module import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", Embedding, cfg, comm),
        *(LayerSpec(TensorParallelBlock, cfg, comm, i) for i in range(cfg.n_layers)),
        LayerSpec(nn.LayerNorm, cfg.d_model),
        TiedLayerSpec("embed", Embedding, cfg, comm, forward_fn=_tied_logits),
    ]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, comm: Any = None) -> torch.Tensor:
    """Mean next-token loss of (vocab-parallel) logits."""
    return vocab_parallel_cross_entropy(logits, targets, comm).mean()
