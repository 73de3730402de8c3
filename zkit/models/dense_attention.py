"""Dense attention, zkit's default ``attention`` plugin.

Scores every query against every key with :func:`torch.nn.functional.scaled_dot_product_attention`,
which picks a fused kernel (flash / memory-efficient on CUDA, a flash kernel on CPU) when it can.
Masks follow the conventions documented in :mod:`zkit.core.attention` (DeepSpeed's
``SparseSelfAttention``), so ``"dense"`` and ``"block_sparse"`` are interchangeable in a model.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zkit
from zkit.core.attention import MASK_MODES
from zkit.core.records import AttentionRecord


def _check_mode(option: str, mode: str) -> str:
    if mode not in MASK_MODES:
        raise ValueError(f"{option} must be 'add' or 'mul', got {mode!r}")
    return mode


def _as_bias(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """A mask in either convention as an additive bias (0 = attend, -inf = do not)."""
    if mask.dtype == torch.bool or mode == "mul":
        keep = mask if mask.dtype == torch.bool else mask != 0
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(keep, zero, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))
    return mask.to(dtype)


class DenseAttention(nn.Module):
    """softmax(Q Kᵀ / √d + mask) V over all query-key pairs.

    Args:
        causal: query ``i`` sees keys ``0..i`` only. When ``seq_q < seq_k`` (queries are the last
            ``seq_q`` positions, as with a key/value cache) the mask is aligned to the bottom right.
        dropout: dropout probability on the attention weights, applied in training mode only.
        key_padding_mask_mode: ``"add"`` (default) or ``"mul"``, see :mod:`zkit.core.attention`.
        attn_mask_mode: ``"mul"`` (default) or ``"add"``.
        num_heads, head_dim, max_seq_length: the model's geometry; when given, inputs are checked
            against it.

    A query row whose every key is masked out yields zeros (and zero gradients), not NaN.
    """

    def __init__(
        self,
        causal: bool = True,
        dropout: float = 0.0,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        num_heads: int | None = None,
        head_dim: int | None = None,
        max_seq_length: int | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise TypeError(
                f"dense attention does not take option(s) {', '.join(sorted(unknown))}; it takes "
                "causal, dropout, key_padding_mask_mode, attn_mask_mode, num_heads, head_dim, "
                "max_seq_length"
            )
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
        for option, value in (("num_heads", num_heads), ("head_dim", head_dim), ("max_seq_length", max_seq_length)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{option} must be a positive integer, got {value!r}")
        self.causal = bool(causal)
        self.dropout = float(dropout)
        self.key_padding_mask_mode = _check_mode("key_padding_mask_mode", key_padding_mask_mode)
        self.attn_mask_mode = _check_mode("attn_mask_mode", attn_mask_mode)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_seq_length = max_seq_length

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, dropout={self.dropout}, "
            f"key_padding_mask_mode={self.key_padding_mask_mode!r}, attn_mask_mode={self.attn_mask_mode!r}"
        )

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for label, t in (("query", q), ("key", k), ("value", v)):
            if t.dim() != 4:
                raise ValueError(
                    f"attention {label} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}"
                )
        if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                "attention query, key and value disagree: query "
                f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} (batch and heads must "
                "match, key and value the same length, query and key the same head_dim)"
            )
        if self.num_heads is not None and q.shape[1] != self.num_heads:
            raise ValueError(f"attention built for {self.num_heads} heads got {q.shape[1]}")
        if self.head_dim is not None and q.shape[-1] != self.head_dim:
            raise ValueError(f"attention built for head_dim {self.head_dim} got {q.shape[-1]}")
        if self.max_seq_length is not None and k.shape[2] > self.max_seq_length:
            raise ValueError(
                f"sequence of {k.shape[2]} keys exceeds the max_seq_length {self.max_seq_length} "
                "the attention was built for"
            )
        if self.causal and q.shape[2] > k.shape[2]:
            raise ValueError(
                f"causal attention needs at least as many keys as queries, got {q.shape[2]} queries "
                f"and {k.shape[2]} keys"
            )

    def _bias(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One additive bias broadcastable to [batch, heads, seq_q, seq_k], or None."""
        batch, _, seq_q, _ = q.shape
        seq_k = k.shape[2]
        bias = None
        if key_padding_mask is not None:
            kpm = key_padding_mask
            if kpm.dim() == 4 and kpm.shape[1] == kpm.shape[2] == 1:
                kpm = kpm[:, 0, 0, :]
            if tuple(kpm.shape) != (batch, seq_k):
                raise ValueError(
                    f"key_padding_mask must be [batch, seq_k] = [{batch}, {seq_k}], got "
                    f"{tuple(key_padding_mask.shape)}"
                )
            bias = _as_bias(kpm, self.key_padding_mask_mode, q.dtype)[:, None, None, :]
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 4) or tuple(attn_mask.shape[-2:]) != (seq_q, seq_k):
                raise ValueError(
                    f"attn_mask must be [seq_q, seq_k] = [{seq_q}, {seq_k}] (or 4-D broadcastable to "
                    f"[batch, heads, seq_q, seq_k]), got {tuple(attn_mask.shape)}"
                )
            extra = _as_bias(attn_mask, self.attn_mask_mode, q.dtype)
            bias = extra if bias is None else bias + extra
        if self.causal and (bias is not None or seq_q != seq_k):
            # Bottom-right aligned: query i (of the last seq_q positions) sees keys <= i + seq_k - seq_q.
            keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
            causal = _as_bias(keep, "mul", q.dtype)
            bias = causal if bias is None else bias + causal
        return bias

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_inputs(query, key, value)
        dropout_p = self.dropout if self.training else 0.0
        bias = self._bias(query, key, key_padding_mask, attn_mask)
        if bias is None:
            # No mask tensor at all: lets SDPA choose its fused causal kernels.
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=self.causal)
        dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
        if not dead.any():
            return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout_p)
        # Rows with nothing to attend to would be NaN: score them as uniform, then zero them out.
        bias = bias.masked_fill(dead, 0.0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout_p)
        return out.masked_fill(dead, 0.0)


@zkit.hookimpl(trylast=True)
def zkit_register_attention():
    yield AttentionRecord(
        name="dense",
        factory=DenseAttention,
        description="every query attends to every (unmasked) key; torch scaled_dot_product_attention",
        aliases=("full",),
    )
