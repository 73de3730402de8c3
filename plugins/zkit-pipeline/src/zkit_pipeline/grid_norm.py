"""The global gradient norm of a model spread over a (pipe, data, tensor) grid, for gradient
clipping and fp16 overflow checks.

The partitioner's norm covers this rank's parameters, reduced over its data-parallel replicas. The
grid norm sums the squares of those norms over the model-parallel group (pipe x tensor), but a
tensor held whole on several model-parallel ranks must count once: a parameter replicated over the
tensor group (layer norms, a row-parallel layer's bias, position embeddings) has the same gradient
on every tensor rank, and a weight tied across pipeline stages has the same summed gradient on
every stage that shares it. Such a parameter enters each rank's square with weight ``1 / copies``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch


def replication_weights(module: torch.nn.Module, tensor_degree: int, tied_copies: Mapping[int, int]) -> dict[int, float]:
    """``{id(param): 1 / copies}`` for every trainable parameter held whole on more than one
    model-parallel rank. ``tied_copies`` maps ``id(param)`` of tied parameters to the number of
    pipeline stages sharing them; parameters without ``tensor_parallel = True`` are replicated over
    the ``tensor_degree`` ranks of the tensor group."""
    weights: dict[int, float] = {}
    for p in module.parameters():
        if not p.requires_grad:
            continue
        copies = tied_copies.get(id(p), 1)
        if tensor_degree > 1 and not getattr(p, "tensor_parallel", False):
            copies *= tensor_degree
        if copies > 1:
            weights[id(p)] = 1.0 / copies
    return weights


def install_grid_norm(partitioner: Any, weights: Mapping[int, float], model_comm: Any) -> None:
    """Make ``partitioner.grad_norm()`` return the norm over the whole grid (per instance: the
    engine asks the partitioner). Idempotent."""
    if getattr(partitioner, "_zkit_grid_norm", False):
        return
    stage_norm: Callable[[], torch.Tensor] = partitioner.grad_norm
    by_name = {name: weights[id(p)] for name, p in partitioner.named_trainable() if id(p) in weights}
    if by_name and not (hasattr(partitioner, "owned") and hasattr(partitioner, "_grad_shards")):
        raise ValueError(
            f"the global gradient norm of a tensor-parallel model or of weights tied across pipeline "
            f"stages needs a ZeRO stage 0-2 partitioner (it reads each parameter's reduced gradient); "
            f"{type(partitioner).__name__} does not expose them"
        )
    multi = model_comm is not None and model_comm.world_size > 1

    def grad_norm() -> torch.Tensor:
        sq = stage_norm().float().reshape(1) ** 2
        if by_name:
            sq = sq - _excess(partitioner, by_name).to(sq.device)
        if multi:
            model_comm.all_reduce(sq, "sum")
        return sq.clamp_min(0.0).sqrt()[0] if torch.isfinite(sq).all() else sq[0]

    partitioner.grad_norm = grad_norm
    partitioner._zkit_grid_norm = True


def _excess(partitioner: Any, weights: Mapping[str, float]) -> torch.Tensor:
    """``sum (1 - w) * |g|^2`` over this rank's reduced gradient pieces of replicated parameters,
    summed over the data-parallel replicas when states are sharded."""
    shards = partitioner._grad_shards()
    pieces, factors = [], []
    for _, unit, a, b, piece in partitioner.owned:
        w = weights.get(piece.slot.name)
        if w is not None and b > a:
            pieces.append(shards[unit][a:b])
            factors.append(1.0 - w)
    out = torch.zeros(1, dtype=torch.float32, device=partitioner.ctx.device)
    if pieces:
        norms = torch.stack(torch._foreach_norm(pieces)).float().to(out.device)
        out += (norms.square() * torch.tensor(factors, device=out.device)).sum()
    if getattr(partitioner, "shards_states", False) and partitioner.comm.world_size > 1:
        partitioner.comm.all_reduce(out, "sum")
    return out
