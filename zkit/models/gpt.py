"""A GPT-2 style decoder: pre-LayerNorm blocks, learned positions, tied input/output embedding.

The model is small enough to read in one sitting and is built to exercise the engine:

* the token embedding and the LM head share one :class:`~torch.nn.Parameter` (with
  ``tie_embeddings=True``), which ZeRO must partition, reduce and checkpoint once;
* the transformer blocks are ``model.blocks`` (an :class:`~torch.nn.ModuleList`), where activation
  checkpointing and pipeline partitioning look for them;
* attention is built by name through :func:`zkit.core.attention.build_attention`, so
  ``GPTConfig(attention="block_sparse")`` runs the ``zkit-sparse`` plugin when it is installed.
"""
from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from zkit.core.attention import build_attention


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"GPTConfig.{attribute.name} must be a positive integer, got {value!r}")


def _dropout(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"GPTConfig.{attribute.name} must be in [0, 1), got {value!r}")


def _attention_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"GPTConfig.attention must be an attention name such as 'dense', got {value!r}")


@attrs.frozen(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``d_model`` must be a multiple of ``n_head``."""

    vocab_size: int = attrs.field(validator=_positive)
    seq_len: int = attrs.field(validator=_positive)
    n_layer: int = attrs.field(validator=_positive)
    n_head: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    dropout: float = attrs.field(default=0.0, validator=_dropout)
    #: name of a registered attention implementation (``"dense"``, ``"block_sparse"``, ...)
    attention: str = attrs.field(default="dense", validator=_attention_name)
    tie_embeddings: bool = True
    #: extra options for the attention factory (a sparse layout, mask modes, ...)
    attention_kwargs: dict[str, Any] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size (see :data:`PRESETS`), with any field overridden::

        GPTConfig.preset("small", attention="block_sparse", seq_len=256)
        """
        try:
            fields = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown GPT preset {name!r}; presets: {', '.join(PRESETS)}") from None
        return cls(**{**fields, **overrides})

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds (a tied head counted once)."""
        d, v = self.d_model, self.vocab_size
        per_block = 12 * d * d + 13 * d  # qkv + proj + 2-layer MLP (4x) weights and biases, 2 LayerNorms
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.seq_len * d + self.n_layer * per_block + 2 * d + head


#: Named sizes. Byte-level (vocab 256) ones train on the example corpus: ``tiny`` (0.18M) for
#: tests, ``mini`` (1.4M) for the two-process CPU demo, ``small`` (4.8M). The others match common
#: benchmark shapes (``medium``: 23M, the GPT-2 family: vocab 50257, 1024 positions).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=80),
    "mini": dict(vocab_size=256, seq_len=128, n_layer=3, n_head=6, d_model=192),
    "small": dict(vocab_size=256, seq_len=128, n_layer=6, n_head=8, d_model=256),
    "medium": dict(vocab_size=8192, seq_len=128, n_layer=6, n_head=8, d_model=512),
    "gpt2-124m": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": dict(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-774m": dict(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, d_model=1280),
    "gpt2-1.5b": dict(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, d_model=1600),
}


class SelfAttention(nn.Module):
    """Fused QKV projection, a pluggable attention core, output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.core = build_attention(
            config.attention,
            causal=True,
            dropout=config.dropout,
            num_heads=config.n_head,
            head_dim=config.head_dim,
            max_seq_length=config.seq_len,
            **config.attention_kwargs,
        )
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        # [batch, seq, 3, heads, head_dim] -> three [batch, heads, seq, head_dim] tensors
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``; ``forward(input_ids, labels)``
    returns the mean cross-entropy of ``labels`` (already aligned: ``labels[:, t]`` is the target for
    position ``t``; ``-100`` is ignored).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter reachable from two modules

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (a tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight plus attention's
        ``12 * n_layer * d_model * seq_len``."""
        seq = self.config.seq_len if seq_len is None else seq_len
        # Embedding look-ups are not matmuls; the head is (and uses wte's weight when tied).
        weights = self.num_parameters() - self.wpe.weight.numel()
        if not self.config.tie_embeddings:
            weights -= self.wte.weight.numel()
        return 6 * weights + 12 * self.config.n_layer * self.config.d_model * seq

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq_len {self.config.seq_len}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``input_ids`` ([batch, seq]) by ``max_new_tokens`` tokens.

        ``temperature=0`` is greedy; otherwise tokens are sampled from the softmax at that
        temperature, restricted to the ``top_k`` most likely when given. The context is cropped to
        the last ``seq_len`` tokens. Returns prompt and continuation together.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        was_training = self.training
        self.eval()
        try:
            ids = input_ids
            for _ in range(max_new_tokens):
                logits = self(ids[:, -self.config.seq_len :])[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
                ids = torch.cat([ids, nxt], dim=1)
            return ids
        finally:
            self.train(was_training)
