"""One micro-step of training: what happens around every backward pass that accumulates parameter
gradients, whoever drives it -- ``engine.backward`` in a plain training loop, or a schedule that
runs its own micro-batches (a pipeline stage's backward instructions)::

    scaled = micro_step.scale(loss)               # x the fp16 loss scale, / accumulation steps
    with micro_step.backward(loss, boundary):     # zkit_before_backward, partitioner.backward_context
        scaled.backward()                         # the partitioner's hooks bucket and reduce
    # on leaving: partitioner.after_backward(boundary), then zkit_after_backward

``boundary`` says whether this is the last micro-step before the optimizer step. Plugins see the
same hooks in the same order whichever loop runs, and the partitioner's reductions (and the
communicator state keyed by them) happen the same way.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import attrs
import torch

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.allocator import Allocator
    from zkit.core.communicator import Communicator
    from zkit.core.engine import Engine
    from zkit.core.partitioner import Partitioner
    from zkit.core.stash import Stash


@attrs.frozen(kw_only=True)
class BackwardContext:
    """What ``zkit_before_backward`` and ``zkit_after_backward`` see of the engine: the partitioner
    whose reduction runs around the backward (its optimizer, its shards), the data-parallel
    communicator it reduces over, the allocator (where its buffers and stores live), and the stash
    (plugins' per-engine state)."""

    partitioner: Partitioner
    comm: Communicator
    allocator: Allocator
    stash: Stash


class MicroStep:
    """The micro-step protocol of one engine (``engine.micro_step_protocol``)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def scale(self, loss: torch.Tensor, divide_by_accumulation: bool = True) -> torch.Tensor:
        """The loss to back-propagate: multiplied by the fp16 loss scale, divided by
        ``gradient_accumulation_steps`` (so accumulated gradients are the batch mean)."""
        engine = self.engine
        scaled = loss.float() * engine.loss_scaler.scale if engine.loss_scaler.enabled else loss
        steps = engine.gradient_accumulation_steps()
        if divide_by_accumulation and steps > 1:
            scaled = scaled / steps
        return scaled

    @contextlib.contextmanager
    def backward(self, loss: torch.Tensor | None, boundary: bool) -> Iterator[None]:
        """Around one backward pass: ``loss`` is the micro-batch's unscaled loss (``None`` on a
        pipeline stage that back-propagates the gradient received from the next stage)."""
        engine, partitioner = self.engine, self.engine.partitioner
        context = self.hook_context()
        engine.pm.hook.zkit_before_backward(micro_step=context, loss=loss, boundary=boundary)
        with partitioner.backward_context(boundary):
            yield
        partitioner.after_backward(boundary)
        engine.pm.hook.zkit_after_backward(micro_step=context)

    def hook_context(self) -> BackwardContext:
        """The backward hooks' view of the engine (made once: the parts it holds are the engine's
        for its life)."""
        context: Any = getattr(self, "_context", None)
        if context is None:
            engine = self.engine
            context = self._context = BackwardContext(partitioner=engine.partitioner, comm=engine.comm,
                                                      allocator=engine.allocator, stash=engine.stash)
        return context

    def reduce(self) -> None:
        """Reduce the batch's gradients now, when its last backward could not (a pipeline sums
        gradients of weights tied across stages first): every gradient is final, so entering and
        leaving the boundary launches and finishes every unit."""
        partitioner = self.engine.partitioner
        with partitioner.backward_context(True):
            pass
        partitioner.after_backward(True)
