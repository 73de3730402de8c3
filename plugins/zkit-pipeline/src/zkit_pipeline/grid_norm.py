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

from typing import Any, Mapping

import torch

from zkit.core.partitioner import ReducedGradients


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


class GridNorm:
    """The grid-wide norm from a rank's data-parallel norm (``__call__``): the pipeline plugin's
    ``zkit_grad_norm`` wrapper applies it to the answer it wraps. ``weights`` as from
    :func:`replication_weights`; ``model_comm`` sums over the model-parallel (pipe x tensor)
    group. Weighing replicated parameters reads their reduced gradients, which needs a
    partitioner that shows them (:class:`zkit.core.partitioner.ReducedGradients`): refused at set-up
    otherwise."""

    def __init__(self, partitioner: Any, weights: Mapping[int, float], model_comm: Any,
                 needed: bool = True) -> None:
        self.by_name = {name: weights[id(p)] for name, p in partitioner.named_trainable() if id(p) in weights}
        if self.by_name and not isinstance(partitioner, ReducedGradients):
            raise ValueError(
                f"the global gradient norm of a tensor-parallel model or of weights tied across pipeline "
                f"stages needs a ZeRO stage 0-2 partitioner (it reads each parameter's reduced gradient); "
                f"{type(partitioner).__name__} does not expose them"
            )
        # a master store that takes the gradients (NVMe offload) holds no reduced gradient in
        # memory to weigh: refused here when a step needs the norm (``needed``), not at that step
        self.unreadable = bool(self.by_name) and not partitioner.shows_reduced_grads
        if self.unreadable and needed:
            raise ValueError(
                "the global gradient norm of a tensor-parallel model or of weights tied across pipeline stages "
                "(gradient clipping, fp16's overflow check) reads each parameter's reduced gradient, which "
                "zero_optimization.offload_optimizer.device 'nvme' keeps in its master store, not in memory. "
                "Use offload_optimizer.device 'cpu', or train without gradient_clipping and fp16"
            )
        self.partitioner = partitioner
        self.model_comm = model_comm if model_comm is not None and model_comm.world_size > 1 else None

    def __call__(self, stage_norm: torch.Tensor) -> torch.Tensor:
        sq = stage_norm.float().reshape(1) ** 2
        if self.unreadable:
            # not needed at set-up (refused there otherwise): only engine.track_grad_norm, set since
            raise RuntimeError(
                "engine.track_grad_norm asks for the global gradient norm of a tensor-parallel model or of weights "
                "tied across pipeline stages, which reads each parameter's reduced gradient; "
                "zero_optimization.offload_optimizer.device 'nvme' keeps them in its master store, not in memory. "
                "Leave track_grad_norm off, or use offload_optimizer.device 'cpu'"
            )
        if self.by_name:
            sq = sq - self._excess(sq.device)
        if self.model_comm is not None:
            self.model_comm.all_reduce(sq, "sum")
        return sq.clamp_min(0.0).sqrt()[0] if torch.isfinite(sq).all() else sq[0]

    def _excess(self, device: torch.device) -> torch.Tensor:
        """``sum (1 - w) * |g|^2`` over this rank's reduced gradient pieces of replicated
        parameters, summed over the data-parallel replicas when states are sharded."""
        pieces, factors = [], []
        for piece in self.partitioner.reduced_grads():
            w = self.by_name.get(piece.name)
            if w is not None and piece.end > piece.start:
                pieces.append(piece.grad)
                factors.append(1.0 - w)
        out = torch.zeros(1, dtype=torch.float32, device=device)
        if pieces:
            norms = torch.stack(torch._foreach_norm(pieces)).float().to(device)
            out += (norms.square() * torch.tensor(factors, device=device)).sum()
        comm = self.partitioner.comm
        if self.partitioner.shards_states and comm.world_size > 1:
            comm.all_reduce(out, "sum")
        return out
