"""Copies between an allocator's buffers: what a partitioner calls, and the plain default.

A partitioner moves data between buffers that may live in different memories (gradients to a host
master, updated weights back, stage-3 shards to the device) through ``allocator.copies``, an object
that follows :class:`Copies`: ``copy(dst, src)`` returns a :class:`Copy` whose :meth:`Copy.wait`
orders the destination's consumer after the copy. An allocator whose copies may run off the
caller's thread gives its own (the built-in allocators use a side stream on an accelerator:
:mod:`zkit.zero.copy_queue`); the default, :class:`SynchronousCopies`, copies on the caller's
thread, so an allocator without streams needs nothing more.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Copy(Protocol):
    """One copy issued by :meth:`Copies.copy`."""

    def wait(self) -> None:
        """Order the destination's consumer after the copy (the compute stream waits for a device
        destination, the host for a host one)."""

    def synchronize(self) -> None:
        """Wait on the host until the copy is done (its source may then be overwritten)."""


class Copies(Protocol):
    """How an allocator copies between its buffers (``allocator.copies``)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """``dst.copy_(src)``, possibly still running when this returns."""

    def to(self, src: torch.Tensor, device: torch.device,
           dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Copy]:
        """``src`` converted to ``device`` and ``dtype``, and the copy to wait for."""

    def synchronize(self) -> None:
        """Wait on the host for every copy still running (before the host overwrites a source)."""


class _Done:
    """A copy that finished before it was returned."""

    __slots__ = ()

    def wait(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "DONE"


#: what a copy that ran on the caller's thread returns
DONE: Copy = _Done()


class SynchronousCopies:
    """:class:`Copies` on the caller's thread: every copy has finished when it returns."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        dst.copy_(src)
        return DONE

    def to(self, src: torch.Tensor, device: torch.device,
           dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Copy]:
        return src.to(device=device, dtype=dtype), DONE

    def synchronize(self) -> None:
        pass
