"""Cross-entropy over logits whose vocabulary is split across the tensor group, without ever
assembling the full ``[tokens, vocab]`` logits: three all-reduces of ``[tokens]``-sized tensors
(max, sum of exponentials, target logit)."""
from __future__ import annotations

from typing import Any

import torch


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: Any) -> torch.Tensor:
        logits = logits.float()
        vocab_per = logits.shape[-1]
        start = comm.rank * vocab_per
        top = logits.max(dim=-1).values
        comm.all_reduce(top, op="max")
        shifted = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + vocab_per)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(picked, op="sum")
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, op="sum")
        loss = total.log() - picked
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return g.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: Any = None) -> torch.Tensor:
    """Per-token loss (shape of ``target``) for ``logits[..., vocab / tp]`` sliced by rank of the
    tensor group ``comm``. With ``comm=None`` (or one rank) it is ordinary cross-entropy."""
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits' "
            f"leading shape {tuple(logits.shape[:-1])}"
        )
    if comm is None or comm.world_size == 1:
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none"
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, comm)
