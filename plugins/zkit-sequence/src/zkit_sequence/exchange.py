"""The two all-to-alls of Ulysses, through a zkit communicator (so its byte counters see them).

Before attention each rank holds every head of its slice of the sequence; after
:func:`heads_to_sequence` it holds ``heads / P`` heads of the whole sequence, and
:func:`sequence_to_heads` undoes that. Each is one ``all_to_all`` of the local tensor, and so is its
backward (an all-to-all of equal chunks is its own adjoint).
"""
from __future__ import annotations

from typing import Any

import torch


class _AllToAll(torch.autograd.Function):
    """``x`` is ``[P, ...]``: chunk ``r`` goes to rank ``r``; chunk ``s`` of the result came from rank ``s``."""

    @staticmethod
    def forward(ctx: Any, comm: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.comm = comm
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        comm.all_to_all(out.view(-1), x.contiguous().view(-1))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        ctx.comm.all_to_all(out.view(-1), grad.contiguous().view(-1))
        return None, out


def heads_to_sequence(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """``[batch, heads, seq / P, dim]`` (every head, this rank's slice) to ``[batch, heads / P, seq,
    dim]`` (this rank's heads, the whole sequence in rank order)."""
    b, h, s, d = x.shape
    p = comm.world_size
    chunks = x.reshape(b, p, h // p, s, d).transpose(0, 1)  # [P (head group), b, h/P, s/P, d]
    y = _AllToAll.apply(comm, chunks)                       # [P (sequence slice), b, h/P, s/P, d]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def sequence_to_heads(y: torch.Tensor, comm: Any) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`."""
    b, h, s, d = y.shape
    p = comm.world_size
    chunks = y.reshape(b, h, p, s // p, d).permute(2, 0, 1, 3, 4)  # [P (sequence slice), b, h, s/P, d]
    x = _AllToAll.apply(comm, chunks)                              # [P (head group), b, h, s/P, d]
    return x.transpose(0, 1).reshape(b, p * h, s // p, d)


def gather_sequence(t: torch.Tensor, comm: Any) -> torch.Tensor:
    """Every rank's ``[batch, seq / P, ...]`` slice put together as ``[batch, seq, ...]``, with no
    gradient (masks)."""
    p = comm.world_size
    flat = t.detach().contiguous()
    out = torch.empty((p, *flat.shape), dtype=flat.dtype, device=flat.device)
    comm.all_gather(out.view(-1), flat.view(-1))
    return out.transpose(0, 1).reshape(flat.shape[0], p * flat.shape[1], *flat.shape[2:])
