"""The data path: each rank of a sequence-parallel group gets its slice of every sequence.

:class:`SequenceShards` wraps any iterable of batches (the engine's data loader, whose sampler gives
every rank its own samples). It takes one batch on each of the ``P`` ranks of the group, shares them,
and yields ``P`` micro-batches in turn: the ``j``-th is rank ``j``'s batch, of which each rank holds
its slice ``[r * seq / P, (r + 1) * seq / P)`` of every tensor's sequence dimension (dim 1). So the
group trains on the same samples, micro-batch for micro-batch, as ``P`` data-parallel ranks would,
and the batch sizes count the group as one replica (``train_batch_size = micro x accumulation x world
/ P``), as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` does.

Each slice comes with its position ids: a batch that carries them (a dict's ``"position_ids"``) is
sliced like the rest; otherwise ``0 .. seq - 1`` are added (a dict gains ``"position_ids"``, a tuple
gains them as its last element). Labels are sliced like the tokens, so they must already be aligned
(``labels[:, t]`` is the target of position ``t``, zkit's convention); non-tensor entries go to every
rank unchanged.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator

import torch

POSITION_IDS = "position_ids"


class SequenceShards:
    """``P`` sliced micro-batches per batch of ``loader``; see the module's text. ``comm`` is the
    sequence-parallel communicator (:func:`zkit_sequence.sequence_communicator`)."""

    def __init__(self, loader: Iterable[Any], comm: Any) -> None:
        self.loader = loader
        self.comm = comm
        self._ready: deque[Any] = deque()
        self._source: Iterator[Any] | None = None

    def __len__(self) -> int:
        return len(self.loader) * self.comm.world_size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._source = iter(self.loader)
        self._ready.clear()
        return self

    def __next__(self) -> Any:
        if self._source is None:
            self._source = iter(self.loader)
        if not self._ready:
            self._refill()
        return self._ready.popleft()

    def _refill(self) -> None:
        try:
            batch = next(self._source)
            mine: Any = ("batch", _to_cpu(batch))
        except StopIteration:
            mine = ("end", None)
        every = self.comm.all_gather_object(mine)
        if any(kind == "end" for kind, _ in every):
            # every rank stops at the same batch: one that ran out ends the epoch for the group
            self._source = None
            raise StopIteration
        for _, batch in every:
            self._ready.append(shard(with_positions(batch), self.comm.rank, self.comm.world_size))


def _to_cpu(batch: Any) -> Any:
    if torch.is_tensor(batch):
        return batch.cpu()
    if isinstance(batch, dict):
        return {k: _to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_cpu(v) for v in batch)
    return batch


def _first_tensor(batch: Any) -> torch.Tensor:
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    for v in values:
        if torch.is_tensor(v) and v.dim() >= 2:
            return v
    raise ValueError(f"a sequence-parallel batch needs a [batch, seq, ...] tensor, got {type(batch).__name__}")


def with_positions(batch: Any) -> Any:
    """``batch`` with position ids ``0 .. seq - 1`` (``[batch, seq]``) added unless it has them."""
    if isinstance(batch, dict) and POSITION_IDS in batch:
        return batch
    tokens = _first_tensor(batch)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    if isinstance(batch, dict):
        return {**batch, POSITION_IDS: positions}
    if isinstance(batch, (list, tuple)):
        return type(batch)([*batch, positions])
    return (batch, positions)


def shard(batch: Any, rank: int, size: int) -> Any:
    """Slice ``rank`` of ``size`` of every tensor's sequence dimension (dim 1) in ``batch``."""
    seq = _first_tensor(batch).shape[1]
    if seq % size:
        raise ValueError(f"a sequence of {seq} tokens does not split over sequence_parallel_size {size}: pad it to a "
                         f"multiple of {size}")
    width = seq // size

    def piece(v: Any) -> Any:
        if torch.is_tensor(v) and v.dim() >= 2:
            if v.shape[1] != seq:
                raise ValueError(f"every [batch, seq, ...] tensor of a batch must have {seq} positions, got shape "
                                 f"{tuple(v.shape)}")
            return v[:, rank * width:(rank + 1) * width].contiguous()
        return v

    if isinstance(batch, dict):
        return {k: piece(v) for k, v in batch.items()}
    return type(batch)(piece(v) for v in batch)
