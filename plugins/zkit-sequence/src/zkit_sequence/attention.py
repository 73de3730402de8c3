"""Ulysses attention: any registered attention, run on ``heads / P`` heads of the whole sequence.

::

    attn = build_attention("ulysses", inner="dense", causal=True, num_heads=8, head_dim=64)
    out = attn(q, k, v)          # [batch, heads, seq / P, head_dim]: this rank's slice of the sequence

Each rank holds every head of its slice of the sequence; an all-to-all
(:func:`~zkit_sequence.exchange.heads_to_sequence`) gives it ``heads / P`` heads of the whole
sequence, the inner attention (built by name through zkit's attention family: ``dense``,
``block_sparse``, ...) runs on them as on one rank, and a second all-to-all returns the output to
the sequence slices. Keys and values with fewer heads than queries (GQA, MQA) travel with their own
head count; when there are fewer key-value heads than ranks each is first repeated so that every rank
gets one, as DeepSpeed's ``UlyssesSPAttentionHF`` does. Before the inner attention the local
key-value heads are repeated to the local query heads (query head ``i`` uses key-value head
``i // (heads / kv_heads)``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zkit.core.attention import build_attention
from zkit_sequence.exchange import gather_sequence, heads_to_sequence, sequence_to_heads


class UlyssesAttention(nn.Module):
    """Sequence-parallel attention around the attention record ``inner``; see the module's text.

    ``num_heads`` (query heads) and ``num_kv_heads`` (default: ``num_heads``) are the model's;
    the other options go to the inner attention, which is built for ``num_heads / P`` heads once
    the module is bound to ``P`` ranks. ``key_padding_mask`` is this rank's slice ``[batch, seq /
    P]`` (gathered here); ``attn_mask`` is the whole sequence's ``[seq, seq]``.
    """

    def __init__(self, inner: str = "dense", *, num_heads: int, num_kv_heads: int | None = None,
                 **inner_options: Any) -> None:
        super().__init__()
        if not isinstance(inner, str) or inner.strip().lower() in ("ulysses",):
            raise ValueError(f"ulysses attention: inner must name another attention record, got {inner!r}")
        for option, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ulysses attention: {option} must be a positive int, got {value!r}")
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % kv:
            raise ValueError(f"ulysses attention: num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv})")
        if _per_head_layout(inner_options):
            raise ValueError("ulysses attention: a block-sparse layout that differs per head "
                             "(different_layout_per_head) cannot be split by heads over sequence-parallel ranks: "
                             "each rank would build the layouts of the first heads")
        self.inner_name = inner
        self.inner_options = dict(inner_options)
        self.num_heads, self.num_kv_heads = num_heads, kv
        self.comm: Any = None
        self.inner = build_attention(inner, num_heads=num_heads, **self.inner_options)

    def extra_repr(self) -> str:
        ranks = 1 if self.comm is None else self.comm.world_size
        return f"inner={self.inner_name!r}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, ranks={ranks}"

    def bind_sequence(self, comm: Any) -> None:
        p = comm.world_size
        if self.num_heads % p:
            raise ValueError(f"sequence_parallel_size {p} does not divide the {self.num_heads} attention heads: "
                             f"Ulysses gives each of the {p} ranks num_heads / {p} heads")
        if self.num_kv_heads % p and p % self.num_kv_heads:
            raise ValueError(f"sequence_parallel_size {p} and the {self.num_kv_heads} key-value heads: one must "
                             f"divide the other (fewer key-value heads than ranks are repeated to one per rank)")
        self.comm = comm
        self.inner = build_attention(self.inner_name, num_heads=self.num_heads // p, **self.inner_options)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"ulysses attention takes [batch, heads, seq, head_dim] tensors, got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        if query.shape[1] != self.num_heads or key.shape[1] != self.num_kv_heads or value.shape[1] != self.num_kv_heads:
            raise ValueError(f"ulysses attention built for {self.num_heads} query and {self.num_kv_heads} key-value "
                             f"heads got {query.shape[1]} and {key.shape[1]}/{value.shape[1]}")
        comm = self.comm
        if comm is None or comm.world_size == 1:
            return self.inner(query, _repeat_kv(key, self.num_heads), _repeat_kv(value, self.num_heads),
                              key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        p = comm.world_size
        if self.num_kv_heads < p:  # MQA and some GQA: one key-value head per rank
            key = key.repeat_interleave(p // self.num_kv_heads, dim=1)
            value = value.repeat_interleave(p // self.num_kv_heads, dim=1)
        q, k, v = (heads_to_sequence(t, comm) for t in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = _gather_mask(key_padding_mask, comm)
        out = self.inner(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]),
                         key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return sequence_to_heads(out, comm)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _gather_mask(mask: torch.Tensor, comm: Any) -> torch.Tensor:
    if mask.dim() == 4:  # DeepSpeed's extended [batch, 1, 1, seq] form
        mask = mask[:, 0, 0, :]
    if mask.dtype == torch.bool:
        return gather_sequence(mask.to(torch.uint8), comm).bool()
    return gather_sequence(mask, comm)


def _per_head_layout(options: dict[str, Any]) -> bool:
    section = options.get("sparse_attention")
    if options.get("different_layout_per_head") or (isinstance(section, dict) and section.get("different_layout_per_head")):
        return True
    sparsity = options.get("sparsity_config")
    return bool(sparsity is not None and getattr(sparsity, "different_layout_per_head", False))


def make_ulysses_attention(*, inner: str = "dense", num_heads: int | None = None, num_kv_heads: int | None = None,
                           **options: Any) -> UlyssesAttention:
    """The ``ulysses`` attention record's factory (the geometry every attention factory gets, plus
    ``inner`` and ``num_kv_heads``)."""
    if num_heads is None:
        raise ValueError("ulysses attention needs num_heads (the model's query heads)")
    return UlyssesAttention(inner, num_heads=num_heads, num_kv_heads=num_kv_heads, **options)
