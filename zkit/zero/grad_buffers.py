"""Gradients written in place: per unit, a flat gradient buffer in the parameters' dtype, and every
parameter's ``.grad`` a view of its slot (DDP's ``gradient_as_bucket_view``). Autograd accumulates
each gradient into its view (one ``add_``, where a fresh ``.grad`` costs a ``detach``), so a unit
goes to its collective, or at one replica straight to the optimizer, without a copy per
parameter. Stages 0-1 hold their gradients this way; stages 2-3 at one replica, where the
reduced shard of a unit is the whole unit (:mod:`zkit.zero.stage2`).

The memory is held from :meth:`GradBuffers.hold` (before a batch's first backward) to
:meth:`GradBuffers.release` (after the step): between them no gradient memory is held (as FSDP2
frees its unsharded parameters, and torch's ``zero_grad(set_to_none=True)`` holds none either).
Every unit's buffer is a slice of one allocation whose storage is resized to nothing and back, so
the buffers and the parameters' views are made once, and one ``zero_`` clears them all.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from zkit.zero.flat import Unit


class GradBuffers:
    """The gradient buffers of ``units`` (see the module docstring).

    Args:
        units: the partitioner's units (each buffer is ``unit.padded`` elements: the padding
            stays zero).
        unit_params: per unit, its parameters in slot order.
        allocator: gives the allocation (purpose ``"grad"``) and counts its bytes while held.
        dtype: the parameters' dtype (a ``.grad`` must have it).
    """

    def __init__(self, units: Sequence[Unit], unit_params: Sequence[Sequence[torch.Tensor]], allocator: Any,
                 dtype: torch.dtype) -> None:
        self.units, self.unit_params, self.allocator, self.dtype = units, unit_params, allocator, dtype
        #: the one allocation every unit's buffer is a slice of (None until first held)
        self.flat: torch.Tensor | None = None
        #: per unit, its flat gradient buffer; without memory between steps
        self.bufs: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}
        self.held = False
        #: (parameter, its view), every parameter's once the views are made
        self._viewed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hold(self) -> list[torch.Tensor]:
        """Give the buffers their memory, zeroed, and point every parameter's ``.grad`` into them
        (before a batch's first backward; :meth:`release` hands the memory back)."""
        if self.held:
            return self.bufs
        if self.flat is None:  # the first batch, or an allocation that cannot give its memory back
            self.flat = self.allocator.zeros(sum(u.padded for u in self.units), self.dtype, "grad")
            start = 0
            self.bufs = []
            for u, params in zip(self.units, self.unit_params):
                buf = self.flat[start : start + u.padded]
                start += u.padded
                for slot, p in zip(u.slots, params):
                    self.views[id(p)] = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                self.bufs.append(buf)
            self._viewed = [(p, self.views[id(p)]) for params in self.unit_params for p in params]
        else:
            nbytes = self.flat.numel() * self.flat.element_size()
            self.flat.untyped_storage().resize_(nbytes)
            self.allocator.track("grad", nbytes)
            self.flat.zero_()
        for p, view in self._viewed:
            p.grad = view
        self.held = True
        return self.bufs

    def take(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final: make sure it is in its view. Someone may have replaced
        ``.grad`` (``model.zero_grad(set_to_none=True)``, a backward outside the engine's, with
        ``create_graph``): its values are copied in."""
        grad = param.grad
        self.hold()
        view = self.views[id(param)]
        if grad is not view:
            view.copy_(grad)
            param.grad = view

    def take_all(self) -> None:
        """:meth:`take` for every parameter at once, where no hook takes each gradient as it
        arrives: a ``.grad`` set but not its view (replaced since the buffers were held, or made
        by a backward before they were) is copied in."""
        if self._viewed:
            strays = [(p, g) for p, view in self._viewed if (g := p.grad) is not view and g is not None]
        else:  # no views yet: every gradient is one
            strays = [(p, p.grad) for params in self.unit_params for p in params if p.grad is not None]
        if not strays:
            return
        self.hold()
        for param, grad in strays:
            view = self.views[id(param)]
            view.copy_(grad)
            param.grad = view

    def release(self) -> None:
        """Hand the memory back and clear every ``.grad``: the next :meth:`hold` starts a new batch."""
        if self.held and self.flat is not None:
            self.allocator.release(self.flat, "grad")
            if owns_its_storage(self.flat):
                self.flat.untyped_storage().resize_(0)
            else:  # an allocator's buffer within a larger one (aligned host memory): made anew
                self.flat, self.bufs, self.views, self._viewed = None, [], {}, []
        self.held = False
        for params in self.unit_params:
            for p in params:
                p.grad = None


def owns_its_storage(buf: torch.Tensor) -> bool:
    """Whether ``buf`` is the whole of a storage that can be resized (torch's own allocation, not a
    slice of a larger or foreign one), so freeing and retaking its memory keeps its views valid."""
    storage = buf.untyped_storage()
    return storage.resizable() and buf.storage_offset() == 0 and storage.nbytes() == buf.numel() * buf.element_size()
