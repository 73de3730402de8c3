"""A small Llama-style decoder for long sequences: RMSNorm, rotary positions from position ids,
grouped-query attention through the ``ulysses`` record (sequence-parallel when bound, plain attention
on one rank), a SwiGLU MLP, an untied head and the sequence-mean loss. ``mlp_tiles`` and
``loss_tiles`` turn on ALST's tiled MLP and tiled logits + loss (:mod:`zkit_sequence.tiling`),
``checkpoint_blocks`` activation checkpointing of each block."""
from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

import zkit.activations
from zkit.core.attention import build_attention
from zkit_sequence.loss import SequenceParallelCrossEntropy
from zkit_sequence.tiling import TiledMLP


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"LlamaConfig.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class LlamaConfig:
    vocab_size: int = attrs.field(validator=_positive)
    n_layer: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    n_head: int = attrs.field(validator=_positive)
    n_kv_head: int = attrs.field(validator=_positive)
    ffn: int = attrs.field(validator=_positive)
    max_seq_len: int = attrs.field(validator=_positive)
    #: the attention record run on each rank's heads (``dense``, ``block_sparse``, ...)
    attention: str = "dense"
    attention_kwargs: dict[str, Any] = attrs.field(factory=dict, converter=dict)
    mlp_tiles: int = attrs.field(default=1, validator=_positive)
    loss_tiles: int = attrs.field(default=1, validator=_positive)
    #: each block through zkit's activation checkpointing (its config section applies: cpu_checkpointing...)
    checkpoint_blocks: bool = False
    rope_theta: float = 10000.0

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: d_model ({self.d_model}) must be n_head ({self.n_head}) times an even "
                             f"head size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def rotate(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (``[batch, heads, seq, dim]``) at ``position_ids`` (``[batch, seq]``)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = position_ids.to(torch.float32)[:, None, :, None] * freqs  # [batch, 1, seq, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.q = nn.Linear(d, cfg.n_head * hd, bias=False)
        self.kv = nn.Linear(d, 2 * cfg.n_kv_head * hd, bias=False)
        self.o = nn.Linear(cfg.n_head * hd, d, bias=False)
        self.core = build_attention("ulysses", inner=cfg.attention, causal=True, num_heads=cfg.n_head,
                                    num_kv_heads=cfg.n_kv_head, head_dim=hd, max_seq_length=cfg.max_seq_len,
                                    **cfg.attention_kwargs)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q(x).view(b, s, self.cfg.n_head, hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.cfg.n_kv_head, hd).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = rotate(q, position_ids, self.cfg.rope_theta), rotate(k, position_ids, self.cfg.rope_theta)
        y = self.core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = TiledMLP(SwiGLU(cfg), cfg.mlp_tiles)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    """``forward(input_ids, labels=None, position_ids=None)``: logits ``[batch, seq, vocab]``
    without labels, else the mean cross-entropy over the real tokens of the whole sequence (labels
    aligned, ``-100`` ignored). ``position_ids`` default to ``0 .. seq - 1``; a rank holding a slice
    of the sequence passes the slice's."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss = SequenceParallelCrossEntropy(cfg.loss_tiles)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            if self.cfg.checkpoint_blocks:
                x = zkit.activations.checkpoint(block, x, position_ids)
            else:
                x = block(x, position_ids)
        x = self.norm(x)
        if labels is None:
            return self.head(x)
        return self.loss(x, self.head, labels)
