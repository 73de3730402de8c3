"""The communicator interface: the collectives a partitioner, an optimizer or a schedule may use.

A communicator is bound to one process group. Every collective counts the bytes *this rank puts on
the wire* under a bandwidth-optimal (ring) algorithm, per collective kind, so benchmarks can compare
measured traffic with the textbook volumes (data parallel moves 2Ψ per rank per step, ZeRO-3 3Ψ):

=================  =============================================
collective         bytes counted on each rank
=================  =============================================
all_reduce         2 (N-1)/N x tensor bytes
reduce_scatter     (N-1)/N x input bytes
all_gather         (N-1)/N x output bytes
all_to_all         (N-1)/N x input bytes
broadcast          tensor bytes on the source rank, 0 elsewhere
send               tensor bytes
=================  =============================================

A compressed communicator counts what it really sends (packed bits plus scales).
"""
from __future__ import annotations

import abc
import contextlib
from collections import defaultdict
from typing import Any, Protocol, Sequence

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


class Handle(Protocol):
    """What an ``async_op=True`` collective returns: call ``wait()`` before reading the result."""

    def wait(self) -> Any: ...


class DoneHandle:
    """A handle for work that already finished (single rank, or a synchronous fallback)."""

    def wait(self) -> None:
        return None


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    return op


class Communicator(abc.ABC):
    """Collectives over one process group, with per-kind call and byte counters.

    Subclasses implement the ``_``-less public methods and call :meth:`account` once per call.
    All tensors are contiguous; ``all_gather``/``reduce_scatter`` work on flat tensors whose sizes
    are exactly ``world_size`` times the shard (the ``*_into_tensor`` forms of torch.distributed).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._stats: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    # -- accounting ---------------------------------------------------------------------------
    def account(self, kind: str, nbytes: int) -> None:
        """Record one call of ``kind`` that put ``nbytes`` on the wire from this rank."""
        entry = self._stats[kind]
        entry[0] += 1
        entry[1] += int(nbytes)

    def ring_bytes(self, kind: str, nbytes: int) -> int:
        """Bytes this rank sends for ``kind`` on ``nbytes`` of data under a ring algorithm."""
        n = self.world_size
        if n == 1:
            return 0
        if kind == "all_reduce":
            return 2 * (n - 1) * nbytes // n
        if kind in ("reduce_scatter", "all_gather", "all_to_all"):
            return (n - 1) * nbytes // n
        return nbytes

    def stats(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": int, "bytes": int}}`` since the last :meth:`reset_stats`."""
        return {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(self._stats.items())}

    def reset_stats(self) -> None:
        self._stats.clear()

    # -- collectives --------------------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, key: str | None = None
    ) -> Handle | None:
        """Reduce ``tensor`` in place across ranks.

        ``key`` names what is reduced, the same name every step (a partitioner passes its
        gradient unit: ``"grad/3"``), for communicators that keep state per reduced tensor (error
        feedback of a compressing communicator); the tensor itself may be a scratch buffer that
        carries another unit next time. Others ignore it."""

    @abc.abstractmethod
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        key: str | None = None,
    ) -> Handle | None:
        """Reduce flat ``input`` (``world_size * output.numel()`` elements) across ranks; rank r
        receives chunk r in ``output``. ``input`` is the collective's to use: afterwards its chunks
        other than this rank's are undefined (a backend may reduce in place). ``output`` may be
        this rank's own chunk of ``input``. ``key`` as for :meth:`all_reduce`."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Concatenate every rank's flat ``input`` into flat ``output`` in rank order."""

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle | None:
        """Chunk r of flat ``input`` goes to rank r; chunk s of ``output`` comes from rank s."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Handle | None:
        """Copy ``tensor`` from global rank ``src`` to every rank of the group."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to global rank ``dst``."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from global rank ``src``."""

    def isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` until the handle's
        ``wait()`` returns. Default: :meth:`send`, done on return (a pipeline whose stages send
        to each other at once needs a communicator that overrides this)."""
        self.send(tensor, dst)
        return DoneHandle()

    def irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start receiving into ``tensor`` from global rank ``src``. Default: :meth:`recv`."""
        self.recv(tensor, src)
        return DoneHandle()

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the group reaches this point."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object per rank (small metadata only)."""

    def coalesced(self) -> contextlib.AbstractContextManager:
        """A block whose collectives (issued with ``async_op=True``, waited after the block) the
        communicator may launch as one batch. Default: issued one by one, as outside."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Free what the communicator created (its own process group)."""

    @abc.abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> "Communicator":
        """A communicator of the same kind over a subset of global ranks. Every rank of the
        parent group must call this with the same ``ranks`` (torch.distributed's rule)."""
