"""Gradients held in full, flat, per-unit buffers (stages 0 and 1).

Each parameter's ``.grad`` is a view into its unit's gradient buffer
(:class:`~zkit.zero.grad_buffers.GradBuffers`), so autograd accumulates micro-steps in place and a
whole unit goes to one collective without a copy. At the last micro-step of a batch, each unit's
collective is launched as soon as its gradients are final. Between steps the buffers hold no
memory (their views are made once).
"""
from __future__ import annotations

import contextlib

import torch

from zkit.zero.buckets import GradientBucketer
from zkit.zero.grad_buffers import GradBuffers
from zkit.zero.zero_partitioner import ZeroPartitioner


class FullGradientPartitioner(ZeroPartitioner):
    """Shared gradient path of stages 0 and 1; subclasses say how a unit is reduced."""

    def _init_grads(self) -> None:
        #: the flat gradient buffers and the parameters' views of them
        self.grad_buffers = GradBuffers(self.units, self.unit_params, self.allocator, self.dtype)
        self.grad_buffers.hold()
        self._reducing = False
        self._scratch: dict[int, torch.Tensor] = {}
        self.bucketer = GradientBucketer(
            [len(ps) for ps in self.unit_params], self._launch, self._finish, names=self.unit_names()
        )

    @property
    def grad_bufs(self) -> list[torch.Tensor]:
        """Per unit, the flat gradient buffer (without memory between steps)."""
        return self.grad_buffers.bufs

    def _ensure_grad_bufs(self) -> list[torch.Tensor]:
        """The gradient buffers, holding their memory (see :meth:`GradBuffers.hold`)."""
        return self.grad_buffers.hold()

    @property
    def keeps_grad_buffers(self) -> bool:
        return True

    @property
    def hooks_each_gradient(self) -> bool:
        # one replica: nothing to reduce, each gradient is in its view already
        return self.comm.world_size > 1

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.grad_buffers.take(param)
        if self._reducing:
            self.bucketer.ready(self.unit_of[id(param)])

    def _final_grad_bufs(self) -> list[torch.Tensor]:
        """The gradient buffers, holding every gradient: without hooks, a ``.grad`` that is not
        its view (made by a backward outside the engine's, or set by the user) is copied in first."""
        if not self._hooked:
            self.grad_buffers.take_all()
        return self._ensure_grad_bufs()

    def backward_context(self, boundary: bool):
        self._final_grad_bufs()
        self._reducing = boundary and self.gradient_reduction and self.comm.world_size > 1
        return contextlib.nullcontext()

    def after_backward(self, boundary: bool) -> None:
        if self._reducing:
            self.bucketer.flush()
        self._reducing = False
        if not self._hooked:
            self.grad_buffers.take_all()

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
        self.grad_buffers.release()
