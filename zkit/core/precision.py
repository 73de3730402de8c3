"""Mixed precision: the model's dtype and fp16 dynamic loss scaling (DeepSpeed's rules).

fp16 gradients overflow; the loss is multiplied by a scale before backward and the gradients
divided by it before the step. On an overflow (a non-finite global gradient norm) the step is
skipped and the scale shrinks, after ``hysteresis`` overflows in a row; after ``loss_scale_window``
clean steps it grows again.
"""
from __future__ import annotations

from typing import Any

import torch

from zkit.core.partitioner import built_partitioned


class LossScaleAtMinimum(RuntimeError):
    """fp16 overflowed with the loss scale already at ``min_loss_scale``: training diverged."""


class LossScaler:
    """Static (``loss_scale > 0``) or dynamic (``loss_scale == 0``) loss scaling."""

    def __init__(
        self,
        *,
        enabled: bool,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        scale_factor: float = 2.0,
    ) -> None:
        self.enabled = enabled
        self.dynamic = enabled and not loss_scale
        self.scale = float(loss_scale or 2.0**initial_scale_power) if enabled else 1.0
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_loss_scale)
        self.factor = scale_factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow = -1

    @classmethod
    def from_config(cls, fp16: Any) -> "LossScaler":
        return cls(
            enabled=fp16.enabled,
            loss_scale=fp16.loss_scale,
            initial_scale_power=fp16.initial_scale_power,
            loss_scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_loss_scale=fp16.min_loss_scale,
        )

    def update(self, overflow: bool, step: int) -> None:
        """Account one optimizer step; ``step`` only names the step in the error."""
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimum(
                        f"fp16 gradients overflowed at step {step} with the loss scale already at its "
                        f"minimum {self.min_scale:g} (fp16.min_loss_scale): training has diverged. "
                        f"Lower the learning rate, enable gradient_clipping, or train in bf16."
                    )
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow": self.last_overflow,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])
        self.hysteresis_left = int(state["hysteresis_left"])


def cast_model(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Move the module's parameters and buffers to ``device`` and the floating-point ones to
    ``dtype``. Parameters already partitioned (built under ``zkit.zero.Init``) are left to the
    partitioner, which moves their shards."""
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or built_partitioned(p):
                    continue
                target = dtype if p.is_floating_point() and dtype != torch.float32 else p.dtype
                if p.device != device or p.dtype != target:
                    p.data = p.data.to(device=device, dtype=target)
            for name, b in m._buffers.items():
                if b is not None:
                    target = dtype if b.is_floating_point() and dtype != torch.float32 else b.dtype
                    m._buffers[name] = b.to(device=device, dtype=target)
    return module
