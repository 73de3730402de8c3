"""Gradients held in full, flat, per-unit buffers (stages 0 and 1).

Each parameter's ``.grad`` is a view into its unit's gradient buffer, so autograd accumulates
micro-steps in place and a whole unit goes to one collective without a copy. At the last
micro-step of a batch, each unit's collective is launched as soon as its gradients are final.

Between steps the buffers hold no memory: their storage is resized to nothing after the step and
back before the next backward (as FSDP2 frees its unsharded parameters), so the buffers and the
parameters' views into them are made once, not a slice and a view per parameter every step.
"""
from __future__ import annotations

import contextlib

import torch

from zkit.zero.buckets import GradientBucketer
from zkit.zero.zero_partitioner import ZeroPartitioner


class FullGradientPartitioner(ZeroPartitioner):
    """Shared gradient path of stages 0 and 1; subclasses say how a unit is reduced."""

    def _init_grads(self) -> None:
        #: per unit, the flat gradient buffer; its storage is empty between steps (see :meth:`zero_grad`)
        self.grad_bufs: list[torch.Tensor] = []
        self.grad_views: dict[int, torch.Tensor] = {}
        self._grads_held = False
        self._ensure_grad_bufs()
        self._reducing = False
        self._scratch: dict[int, torch.Tensor] = {}
        self.bucketer = GradientBucketer(
            [len(ps) for ps in self.unit_params], self._launch, self._finish, names=self.unit_names()
        )

    def _ensure_grad_bufs(self) -> list[torch.Tensor]:
        """Give the gradient buffers their memory, zeroed, and point every parameter's ``.grad``
        into them (before a batch's first backward; the memory goes back after the step)."""
        if self._grads_held:
            return self.grad_bufs
        if not self.grad_bufs:  # the first batch, or buffers that cannot give their memory back
            for u, params in zip(self.units, self.unit_params):
                buf = self.allocator.zeros(u.padded, self.dtype, "grad")
                for slot, p in zip(u.slots, params):
                    self.grad_views[id(p)] = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                self.grad_bufs.append(buf)
        else:
            for buf in self.grad_bufs:
                nbytes = buf.numel() * buf.element_size()
                buf.untyped_storage().resize_(nbytes)
                self.allocator.track("grad", nbytes)
                buf.zero_()
        for params in self.unit_params:
            for p in params:
                p.grad = self.grad_views[id(p)]
        self._grads_held = True
        return self.grad_bufs

    @property
    def keeps_grad_buffers(self) -> bool:
        return True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._ensure_grad_bufs()  # a backward run outside engine.backward
        view = self.grad_views[id(param)]
        if param.grad is not view:
            # Someone replaced .grad (model.zero_grad(set_to_none=True)): take the new values.
            view.copy_(param.grad)
            param.grad = view
        if self._reducing:
            self.bucketer.ready(self.unit_of[id(param)])

    def backward_context(self, boundary: bool):
        self._ensure_grad_bufs()
        self._reducing = boundary and self.gradient_reduction and self.comm.world_size > 1
        return contextlib.nullcontext()

    def after_backward(self, boundary: bool) -> None:
        if self._reducing:
            self.bucketer.flush()
        self._reducing = False

    def _comm_buffer(self, unit: int) -> torch.Tensor:
        """The unit's gradients in the communication dtype (a scratch copy when it differs),
        pre-divided when the config asks for it."""
        buf = self.grad_bufs[unit]
        if self.comm_dtype != buf.dtype:
            scratch = self.allocator.empty(buf.numel(), self.comm_dtype, "bucket")
            scratch.copy_(buf)
            self._scratch[unit] = scratch
            buf = scratch
        if self.pre_scale != 1.0:
            buf.mul_(self.pre_scale)
        return buf

    def _reduced(self, unit: int, buf: torch.Tensor) -> torch.Tensor:
        """The part of a unit's communication buffer that holds this rank's reduced result."""
        raise NotImplementedError

    def _launch(self, unit: int):
        raise NotImplementedError

    def _finish(self, unit: int) -> None:
        scratch = self._scratch.pop(unit, None)
        if self.post_scale != 1.0:
            self._reduced(unit, scratch if scratch is not None else self.grad_bufs[unit]).mul_(self.post_scale)
        if scratch is not None:
            self._copy_back(unit, scratch)
            self.allocator.release(scratch, "bucket")

    def _copy_back(self, unit: int, scratch: torch.Tensor) -> None:
        self.grad_bufs[unit].copy_(scratch)

    def zero_grad(self) -> None:
        # Between steps no gradient memory is held (DeepSpeed and torch's zero_grad(set_to_none=True)
        # hold none either): the buffers' storage goes back and the next backward takes it again.
        if self._grads_held:
            for buf in self.grad_bufs:
                self.allocator.release(buf, "grad")
            if all(_owns_its_storage(buf) for buf in self.grad_bufs):
                for buf in self.grad_bufs:
                    buf.untyped_storage().resize_(0)
            else:  # an allocator's buffer within a larger one (aligned host memory): made anew
                self.grad_bufs, self.grad_views = [], {}
        self._grads_held = False
        for params in self.unit_params:
            for p in params:
                p.grad = None


def _owns_its_storage(buf: torch.Tensor) -> bool:
    """Whether ``buf`` is the whole of a storage that can be resized (torch's own allocation, not a
    slice of a larger or foreign one), so freeing and retaking its memory keeps its views valid."""
    storage = buf.untyped_storage()
    return storage.resizable() and buf.storage_offset() == 0 and storage.nbytes() == buf.numel() * buf.element_size()
