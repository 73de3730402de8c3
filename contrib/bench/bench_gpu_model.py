"""The one-GPU benchmark's model: a GPT written as plain ``nn.Module`` s, as a user would write it
(nothing of zkit inside), and the FLOPs a training step of it costs.

Learned positions, pre-norm blocks (LayerNorm, causal ``scaled_dot_product_attention``, a 4x GELU
MLP), an untied output head. At 24 layers, width 1024, vocabulary 32000 and 1024 positions it has
369.6M parameters."""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn


@attrs.frozen(kw_only=True)
class Shape:
    layers: int = 24
    width: int = 1024
    heads: int = 16
    vocab: int = 32000
    seq: int = 1024

    def parameters(self) -> int:
        d = self.width
        block = 12 * d * d + 13 * d  # qkv, proj, 2 MLP matrices with biases, 2 LayerNorms
        return self.layers * block + 2 * self.vocab * d + self.seq * d + 2 * d

    def step_flops(self, tokens: int) -> float:
        """Model FLOPs of forward and backward over ``tokens`` tokens: 6 per parameter per token,
        plus attention's scores and weighted sum (12 x layers x width x sequence per token; the
        causal mask's skipped half counted, as the usual MFU figures count it)."""
        return 6.0 * self.parameters() * tokens + 12.0 * self.layers * self.width * self.seq * tokens


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.width)
        self.qkv = nn.Linear(s.width, 3 * s.width)
        self.proj = nn.Linear(s.width, s.width)
        self.ln2 = nn.LayerNorm(s.width)
        self.up = nn.Linear(s.width, 4 * s.width)
        self.down = nn.Linear(4 * s.width, s.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PlainGPT(nn.Module):
    """``model(ids, labels)`` returns the mean next-token cross-entropy."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.width)
        self.pos = nn.Embedding(s.seq, s.width)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation (also what FSDP2 calls after allocating a model built on meta)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
