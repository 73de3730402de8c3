"""Tensor-parallel layers: each rank of the tensor group holds a slice of the weight.

* :class:`ColumnParallelLinear` splits the output features: ``Y_i = X A_i``; no communication in
  forward (the input is copied to every rank; its gradient is all-reduced in backward).
* :class:`RowParallelLinear` splits the input features: ``Y = sum_i X_i A_i``, one all-reduce in
  forward. A column layer followed by a row layer (an MLP, attention) thus costs one all-reduce
  forward and one backward.
* :class:`VocabParallelEmbedding` splits the vocabulary rows; ids outside a rank's range read zeros
  and the all-reduce assembles the embedding.

Weights are initialised whole from ``seed`` and sliced, so any tensor-parallel degree (1 included)
starts from the very same model; :meth:`from_dense` slices an existing layer.

Sliced parameters carry ``tensor_parallel = True``; every other parameter of a tensor-parallel model
is replicated over the tensor group, which the global gradient norm counts once.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from zkit_pipeline.tensor_parallel.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)

Init = Callable[[torch.Tensor, torch.Generator], None]


def mark_tensor_parallel(*params: nn.Parameter | None) -> None:
    """Mark parameters as sliced over the tensor group (each rank holds a different part)."""
    for p in params:
        if p is not None:
            p.tensor_parallel = True


def normal_init(std: float = 0.02) -> Init:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        with torch.no_grad():
            t.normal_(0.0, std, generator=gen)

    return init


def _rank_size(comm: Any) -> tuple[int, int]:
    return (0, 1) if comm is None else (comm.rank, comm.world_size)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({parts})")
    return total // parts


def _full_then_slice(shape: tuple[int, ...], dim: int, rank: int, size: int, seed: int, init: Init,
                     dtype: torch.dtype) -> torch.Tensor:
    full = torch.empty(shape, dtype=dtype, device="cpu")  # the seeded host generator fills it
    init(full, torch.Generator().manual_seed(seed))
    return full.chunk(size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s output rows split over the tensor group.

    With ``gather_output`` the full output is assembled on every rank; otherwise each rank returns
    its slice (feed it to a :class:`RowParallelLinear` with ``input_is_parallel=True``)."""

    def __init__(self, in_features: int, out_features: int, comm: Any = None, *, bias: bool = True,
                 gather_output: bool = False, seed: int = 0, init: Init | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        rank, size = _rank_size(comm)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _divide(out_features, size, "ColumnParallelLinear out_features")
        self.gather_output = gather_output
        init = init or normal_init()
        self.weight = nn.Parameter(_full_then_slice((out_features, in_features), 0, rank, size, seed, init, dtype))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype, device="cpu")) if bias else None
        mark_tensor_parallel(self.weight, self.bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Any = None, *, gather_output: bool = False) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    gather_output=gather_output, dtype=linear.weight.dtype)
        rank, size = _rank_size(comm)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(size, 0)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(size, 0)[rank])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.comm), self.weight, self.bias)
        return gather_from_group(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} ({self.out_per_rank} per rank)"


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s input columns split over the tensor group; the partial
    products are summed with one all-reduce, then the (replicated) bias is added."""

    def __init__(self, in_features: int, out_features: int, comm: Any = None, *, bias: bool = True,
                 input_is_parallel: bool = True, seed: int = 0, init: Init | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        rank, size = _rank_size(comm)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, size, "RowParallelLinear in_features")
        self.input_is_parallel = input_is_parallel
        init = init or normal_init()
        self.weight = nn.Parameter(_full_then_slice((out_features, in_features), 1, rank, size, seed, init, dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device="cpu")) if bias else None  # replicated
        mark_tensor_parallel(self.weight)

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Any = None, *, input_is_parallel: bool = True) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, dtype=linear.weight.dtype)
        rank, size = _rank_size(comm)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(size, 1)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.comm)
        y = reduce_from_group(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features} ({self.in_per_rank} per rank), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the tensor group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Any = None, *, seed: int = 0,
                 init: Init | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        rank, size = _rank_size(comm)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = _divide(num_embeddings, size, "VocabParallelEmbedding num_embeddings")
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        init = init or normal_init()
        self.weight = nn.Parameter(_full_then_slice((num_embeddings, embedding_dim), 0, rank, size, seed, init, dtype))
        mark_tensor_parallel(self.weight)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: Any = None) -> "VocabParallelEmbedding":
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, dtype=embedding.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.vocab_start : layer.vocab_end])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None or self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"
