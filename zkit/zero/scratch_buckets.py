"""The scratch buckets stage 2-3's reductions pack gradients into (:class:`ScratchBuckets`): the
segments of a :class:`~zkit.zero.buckets.ScratchRing` as tensors, and, for each place a unit lands
in them, the views its parameters' gradients are copied into.

A step takes the same places in the same order every time, so the views are made once (a slice
and a view per parameter at every reduction before), and a unit's gradients go into its bucket
with one ``_foreach_copy_`` (a kernel launch for the unit, not one per parameter). Between steps
the segments hold no memory: their storage is resized to nothing after the step and back at the
next batch's first reduction, as the gradient buffers of :mod:`zkit.zero.grad_buffers` are.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from zkit.zero.buckets import ScratchRing
from zkit.zero.flat import Unit
from zkit.zero.grad_buffers import owns_its_storage


class Bucket:
    """One unit's place in a segment: ``flat`` (the whole padded unit), ``views`` (each
    parameter's slot, shaped as the parameter), ``padding`` (None when there is none), ``real``
    (the unit's elements) and ``chunk`` (this rank's shard of it)."""

    __slots__ = ("segment", "flat", "views", "padding", "real", "chunk")

    def __init__(self, segment: torch.Tensor, start: int, unit: Unit, rank: int) -> None:
        self.segment = segment
        self.flat = segment[start : start + unit.padded]
        self.views = [self.flat[s.offset : s.offset + s.numel].view(s.shape) for s in unit.slots]
        self.padding = self.flat[unit.numel :] if unit.padded > unit.numel else None
        self.real = self.flat[: unit.numel]
        lo, hi = unit.shard_range(rank)
        self.chunk = self.flat[lo:hi]

    def fill(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Copy a unit's gradients in (a gradient ``None``, unused in this forward, as zeros) and
        zero the padding."""
        if all(g is not None for g in grads):
            torch._foreach_copy_(self.views, list(grads))
        else:
            for view, g in zip(self.views, grads):
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
        if self.padding is not None:
            self.padding.zero_()


class ScratchBuckets:
    """Buckets for ``units`` in ``ring``'s segments of ``dtype`` (purpose ``"bucket"``, from
    ``allocator``), this rank's chunk being shard ``rank`` (see the module docstring)."""

    def __init__(self, ring: ScratchRing, units: Sequence[Unit], dtype: torch.dtype, allocator: Any,
                 rank: int) -> None:
        self.ring, self.units, self.dtype, self.allocator, self.rank = ring, units, dtype, allocator, rank
        #: the ring's segments (a bucket of the largest unit each), made by the first reduction that
        #: needs one; without memory between steps
        self.segments: list[torch.Tensor | None] = [None] * ring.count
        self._held = [False] * ring.count
        self._buckets: dict[tuple[int, int, int], Bucket] = {}

    def take(self, unit: int) -> Bucket:
        """The next place in the ring for ``unit`` (the caller checked it fits), its segment holding
        memory."""
        u = self.units[unit]
        seg, start, _ = self.ring.take(u.padded)
        segment = self._hold(seg)
        bucket = self._buckets.get((unit, seg, start))
        if bucket is None or bucket.segment is not segment:
            bucket = self._buckets[(unit, seg, start)] = Bucket(segment, start, u, self.rank)
        return bucket

    def _hold(self, seg: int) -> torch.Tensor:
        segment = self.segments[seg]
        if segment is None:
            segment = self.segments[seg] = self.allocator.empty(self.ring.segment, self.dtype, "bucket")
        elif not self._held[seg]:
            nbytes = segment.numel() * segment.element_size()
            segment.untyped_storage().resize_(nbytes)
            self.allocator.track("bucket", nbytes)
        self._held[seg] = True
        return segment

    def give_back(self) -> None:
        """The oldest bucket taken is free again (its reduction finished)."""
        self.ring.give_back()

    def release(self) -> None:
        """After the step: the segments' memory goes back (a segment within an allocator's larger
        block, which cannot be resized, is made anew)."""
        for seg, segment in enumerate(self.segments):
            if segment is None or not self._held[seg]:
                continue
            self.allocator.release(segment, "bucket")
            if owns_its_storage(segment):
                segment.untyped_storage().resize_(0)
            else:
                self.segments[seg] = None
            self._held[seg] = False
