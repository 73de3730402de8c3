"""Dense float64 attention with the block layout materialised: the reference of every test."""
from __future__ import annotations

import math

import torch


def dense_reference(q, k, v, layout, block, causal=False, key_padding=None, attn_mask=None):
    """softmax(QK^T / sqrt(d) + masks) V over the [heads, nb, nb] layout; fully masked rows -> 0."""
    t = q.shape[2]
    present = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~present[None], float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    if key_padding is not None:
        s = s + key_padding[:, None, None, :]
    if attn_mask is not None:
        s = s + attn_mask
    seen = torch.isfinite(s).any(-1, keepdim=True)  # rows with at least one visible key
    return torch.softmax(torch.where(seen, s, 0.0), -1) * seen @ v
