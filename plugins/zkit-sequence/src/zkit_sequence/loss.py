"""The loss of a sequence split over ranks: the mean over the real tokens of the whole sequence.

Each rank sums the cross-entropy of its slice's tokens (labels ``-100``, padding included, count for
nothing, as ``torch.nn.functional.cross_entropy(ignore_index=-100)`` counts them) and counts them;
one all-reduce of ``[sum, count]`` over the sequence-parallel ranks gives every rank the loss of the
unsharded batch. Its backward all-reduces the incoming gradient too (the adjoint of a sum every rank
receives), so each rank's slice gets ``P`` times its share: the partitioner, which averages gradients
over all ``data x sequence`` ranks, then holds the gradient of the unsharded loss.

With ``tiles`` the head and the loss run over ``tiles`` chunks of tokens, each recomputed in
backward (:func:`zkit_sequence.tiling.tiled_logits_loss_sum`): the ``[tokens, vocab]`` logits never
exist whole.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zkit_sequence.tiling import logits_loss_sum, tiled_logits_loss_sum

IGNORE_INDEX = -100


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Any, t: torch.Tensor) -> torch.Tensor:
        ctx.comm = comm
        out = t.detach().clone().contiguous()
        comm.all_reduce(out, "sum")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        out = grad.contiguous().clone()
        ctx.comm.all_reduce(out, "sum")
        return None, out


def mean_over_sequence(loss_sum: torch.Tensor, count: torch.Tensor, comm: Any = None) -> torch.Tensor:
    """``loss_sum / count`` summed over the ranks of ``comm`` (``None`` or one rank: this rank's)."""
    both = torch.stack([loss_sum.float(), count.to(torch.float32)])
    if comm is not None and comm.world_size > 1:
        both = _SumOverRanks.apply(comm, both)
    return both[0] / both[1]


def sequence_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, comm: Any = None) -> torch.Tensor:
    """The token-mean cross-entropy of ``labels`` (aligned: ``labels[:, t]`` is the target of
    position ``t``; ``-100`` ignored) over the whole sequence split over ``comm``'s ranks."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    target = labels.reshape(-1)
    loss_sum = F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return mean_over_sequence(loss_sum, (target != IGNORE_INDEX).sum(), comm)


class SequenceParallelCrossEntropy(nn.Module):
    """The LM head applied and the sequence-mean cross-entropy taken, for a model split
    over sequence-parallel ranks (bound like :class:`~zkit_sequence.attention.UlyssesAttention`;
    unbound, the whole sequence's loss on one rank). ``tiles`` > 1: the logits in that many chunks
    of tokens, each recomputed in backward."""

    def __init__(self, tiles: int = 1) -> None:
        super().__init__()
        if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
            raise ValueError(f"SequenceParallelCrossEntropy: tiles must be a positive int, got {tiles!r}")
        self.tiles = tiles
        self.comm: Any = None

    def bind_sequence(self, comm: Any) -> None:
        self.comm = comm

    def extra_repr(self) -> str:
        return f"tiles={self.tiles}, ranks={1 if self.comm is None else self.comm.world_size}"

    def forward(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """The loss of ``head(hidden)`` (``[batch, seq, vocab]`` logits) against ``labels``."""
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"labels must have the hidden states' leading shape {tuple(hidden.shape[:-1])}, got "
                             f"{tuple(labels.shape)}")
        h = hidden.reshape(-1, hidden.shape[-1])
        target = labels.reshape(-1)
        if self.tiles == 1:
            loss_sum = logits_loss_sum(head, h, target)
        else:
            loss_sum = tiled_logits_loss_sum(head, h, target, self.tiles)
        return mean_over_sequence(loss_sum, (target != IGNORE_INDEX).sum(), self.comm)
