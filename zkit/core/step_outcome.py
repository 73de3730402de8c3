"""What the optimizer steps came to: applied or skipped, the gradient norm, the skipped-step
count. A step that decides on the device (its non-finite check and clipping stay there, so the
host never waits for it) records tensors; they are read only when someone asks
(:meth:`zkit.core.engine.Engine.was_step_applied`, ``skipped_steps``,
``get_global_grad_norm()``), so a training loop that does not ask never waits for the device."""
from __future__ import annotations

import torch

#: device flags of skipped steps kept unread before they are summed on the device (a bound on
#: the memory of a loop that never reads ``skipped_steps``)
_FOLD_AT = 1024


class StepOutcomes:
    """The engine's record of its optimizer steps (see the module docstring)."""

    def __init__(self) -> None:
        self._skipped = 0
        #: 0-dim tensors not read yet: each step's applied flag (a folded one: how many were applied)
        self._pending: list[torch.Tensor] = []
        #: the steps those flags stand for
        self._pending_steps = 0
        self._applied: bool | torch.Tensor = False
        self._grad_norm: float | torch.Tensor | None = None

    def record(self, applied: bool | torch.Tensor, grad_norm: float | torch.Tensor | None) -> None:
        """One step: ``applied`` a bool, or a 0-dim bool tensor; ``grad_norm`` a float, a 0-dim
        tensor or None (the step computed none)."""
        self._grad_norm = grad_norm
        if torch.is_tensor(applied):
            self._pending.append(applied)  # the flag itself: nothing dispatched per step
            self._pending_steps += 1
            if len(self._pending) >= _FOLD_AT:
                self._pending = [self._applied_pending()]
        elif not applied:
            self._skipped += 1

    @property
    def skipped(self) -> int:
        if self._pending:
            self._skipped += self._pending_steps - int(self._applied_pending().item())
            self._pending, self._pending_steps = [], 0
        return self._skipped

    def _applied_pending(self) -> torch.Tensor:
        """How many of the pending steps were applied (on the device)."""
        return torch.stack([flag.to(torch.int64) for flag in self._pending]).sum()

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._skipped, self._pending, self._pending_steps = int(value), [], 0

    @property
    def applied(self) -> bool:
        """Whether the last step was applied (what the step hook returned)."""
        if torch.is_tensor(self._applied):
            self._applied = bool(self._applied.item())
        return self._applied

    @property
    def applied_unread(self) -> bool | torch.Tensor:
        """What the step hook returned, a device flag left unread."""
        return self._applied

    @applied.setter
    def applied(self, value: bool | torch.Tensor) -> None:
        self._applied = value if torch.is_tensor(value) else bool(value)

    @property
    def grad_norm(self) -> float | None:
        if torch.is_tensor(self._grad_norm):
            self._grad_norm = float(self._grad_norm.item())
        return self._grad_norm
