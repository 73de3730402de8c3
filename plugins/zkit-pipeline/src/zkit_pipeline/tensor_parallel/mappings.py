"""The four autograd functions tensor parallelism is built from (Megatron-LM's f and g operators).

Each is a pair of collectives on the tensor-parallel group, one in forward and its adjoint in
backward. ``comm`` is a :class:`zkit.core.communicator.Communicator` over that group; ``None`` or a group of one
rank makes every function the identity, so the same layers run unsharded.
"""
from __future__ import annotations

from typing import Any

import torch


def _size(comm: Any) -> int:
    return 1 if comm is None else comm.world_size


def _all_reduce(x: torch.Tensor, comm: Any) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, op="sum")
    return x


def _gather_last(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order."""
    n = comm.world_size
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(flat, x.contiguous().view(-1))
    return flat.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def _split_last(x: torch.Tensor, comm: Any) -> torch.Tensor:
    n = comm.world_size
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[comm.rank].contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (the input fed every rank's shard)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: all-reduce the partial sums. Backward: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """Forward: concatenate shards along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.comm), None


class _ScatterToGroup(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: concatenate."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.comm), None


def copy_to_group(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return x if _size(comm) == 1 else _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return x if _size(comm) == 1 else _ReduceFromGroup.apply(x, comm)


def gather_from_group(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return x if _size(comm) == 1 else _GatherFromGroup.apply(x, comm)


def scatter_to_group(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return x if _size(comm) == 1 else _ScatterToGroup.apply(x, comm)
