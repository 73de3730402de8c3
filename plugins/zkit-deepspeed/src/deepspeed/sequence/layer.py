"""``deepspeed.sequence.layer.DistributedAttention``: DeepSpeed-Ulysses around a local attention,
over zkit-sequence's all-to-alls (``zkit_sequence.exchange``), which go through zkit's communicator
for the group (counted in its ``all_to_all`` bytes).

As DeepSpeed's: ``DistributedAttention(local_attention, sequence_process_group, scatter_idx=2,
gather_idx=0)``; ``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)``
takes this rank's slice of the sequence, ``[batch, seq / P, heads, dim]`` (``batch_dim_idx=0``) or
``[seq / P, batch, heads, dim]`` (``batch_dim_idx=1``), calls ``local_attention`` on ``heads / P``
heads of the whole sequence in the same layout, and returns the context as this rank's slice. Keys
and values may have fewer heads than queries, as long as ``P`` divides them; DeepSpeed's uneven
split of fewer key-value heads than ranks, its ``rotary_pos_emb`` argument and its overlapping
``sp_stream`` are refused with a message.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed.refused import FeatureNotProvided
from zkit_deepspeed.optional import import_plugin


class DistributedAttention(torch.nn.Module):
    def __init__(self, local_attention: torch.nn.Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: scatter_idx={scatter_idx}, gather_idx={gather_idx}: zkit splits "
                             f"the heads (scatter_idx=2) and gathers the sequence (gather_idx=0 or 1, by layout)")
        if sp_stream is not None:
            raise FeatureNotProvided("DistributedAttention(sp_stream=...) (all-to-alls overlapped on a side stream) "
                                     "is not provided by zkit: leave sp_stream None")
        from zkit.torch_distributed import DeferredCommunicator

        self.exchange = import_plugin("zkit_sequence.exchange", "deepspeed.sequence.layer.DistributedAttention")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        #: the group's communicator: the installed plugins' choice (zkit's torch communicator)
        self.comm = DeferredCommunicator(sequence_process_group)

    def _heads_first(self, t: Tensor, batch_dim_idx: int) -> Tensor:
        return t.permute(0, 2, 1, 3) if batch_dim_idx == 0 else t.permute(1, 2, 0, 3)

    def _layout(self, t: Tensor, batch_dim_idx: int) -> Tensor:
        return t.permute(0, 2, 1, 3) if batch_dim_idx == 0 else t.permute(2, 0, 1, 3)

    def _to_heads(self, t: Tensor, batch_dim_idx: int, what: str) -> Tensor:
        p = self.comm.world_size
        if t.dim() != 4 or t.shape[2] % p:
            raise ValueError(f"DistributedAttention: the {what} must be 4-D with heads (dim 2) divisible by the "
                             f"{p} sequence-parallel ranks, got {tuple(t.shape)} (DeepSpeed's uneven head split is "
                             f"not provided by zkit)")
        return self._layout(self.exchange.heads_to_sequence(self._heads_first(t, batch_dim_idx), self.comm),
                            batch_dim_idx)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 "
                             f"([seq, batch, heads, dim]), got {batch_dim_idx!r}")
        if rotary_pos_emb is not None:
            raise FeatureNotProvided("DistributedAttention(rotary_pos_emb=...) is not provided by zkit: apply the "
                                     "rotary embedding to the slices before the call, at their positions")
        q, k, v = (self._to_heads(t, batch_dim_idx, what) for t, what in ((query, "query"), (key, "key"),
                                                                         (value, "value")))
        context = self.local_attn(q, k, v, *args, **kwargs)
        back = self.exchange.sequence_to_heads(self._heads_first(context, batch_dim_idx), self.comm)
        return self._layout(back, batch_dim_idx)
