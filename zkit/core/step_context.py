"""What an optimizer step sees: the argument of the ``zkit_optimizer_step`` and ``zkit_grad_norm``
hooks, in place of the whole engine.

A step reads the config's step settings, this batch's losses and the loss scale, asks the global
gradient norm, drives the partitioner (step, skip, zero the gradients; the non-finite check of
its gradients), advances the LR schedule, keeps its own state in the engine's stash, and says what
came of it through :meth:`StepContext.record`, the one thing it changes on the engine. The engine
builds one per step; nothing here reaches back into the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.communicator import Communicator
    from zkit.core.config import ZkitConfig
    from zkit.core.partitioner import Partitioner
    from zkit.core.precision import LossScaler
    from zkit.core.stash import Stash


@attrs.frozen(kw_only=True)
class StepContext:
    """One optimizer step at an accumulation boundary (see the module docstring)."""

    #: the step this is: the engine's ``global_steps`` after it (1 for the first)
    number: int
    #: gradient_clipping, steps_per_print, nonfinite_steps_limit
    config: ZkitConfig
    #: the data-parallel ranks' partitioner: ``step``, ``skip_step``, ``zero_grad``, ``grads_finite``,
    #: ``grad_norm``, ``gradient_reduction``, ``optimizer``
    partitioner: Partitioner
    #: the data-parallel group's communicator (what the partitioner reduces over)
    comm: Communicator
    #: the fp16 loss scale (disabled, at scale 1.0, in bf16 and fp32): the step updates it
    loss_scaler: LossScaler
    #: the LR schedule the step advances, or ``None``
    lr_scheduler: Any
    #: plugins' per-engine state (:mod:`zkit.core.stash`)
    stash: Stash
    #: the detached losses of this batch's micro-steps, still on the device
    batch_losses: tuple[torch.Tensor, ...]
    #: whether the step needs the global gradient norm: fp16's overflow check, clipping, or
    #: ``engine.track_grad_norm``
    needs_grad_norm: bool
    device: torch.device
    rank: int
    world_size: int
    #: the ``zkit_grad_norm`` hook's answer for this step (:meth:`grad_norm`)
    _grad_norm: Callable[["StepContext"], Any] = attrs.field(alias="grad_norm_hook", repr=False)
    #: the engine's record of its steps' outcomes (:meth:`record`)
    _record: Callable[[bool | torch.Tensor, float | torch.Tensor | None], None] = attrs.field(
        alias="record_outcome", repr=False)

    def grad_norm(self) -> Any:
        """The global L2 norm of this batch's gradients, still multiplied by the loss scale: the
        answer of ``zkit_grad_norm`` (wrapped by every plugin that changes what "global" means)."""
        return self._grad_norm(self)

    def record(self, applied: bool | torch.Tensor, grad_norm: float | torch.Tensor | None = None) -> None:
        """Say what came of the step: ``applied`` (a 0-dim bool tensor when it decided on the
        device; a skipped step counts in ``engine.skipped_steps``) and the unscaled ``grad_norm``
        (``None`` when the step computed none), what ``engine.get_global_grad_norm()`` answers.
        Tensors are read only when asked for (:mod:`zkit.core.step_outcome`)."""
        self._record(applied, grad_norm)
