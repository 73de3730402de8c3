"""``deepspeed.ops.lion.DeepSpeedCPULion``: zkit-offload's CPU Lion with DeepSpeed's signature and
defaults (``lr=1e-3, betas=(0.9, 0.999), weight_decay=0``)."""
from __future__ import annotations

from typing import Any, Iterable

from zkit_deepspeed.optional import import_plugin

CPULion = import_plugin("zkit_offload.cpu_lion", "deepspeed.ops.lion").CPULion

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(CPULion):
    """``fp32_optimizer_states=False`` is refused: zkit keeps optimizer state in fp32."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False) is not supported: zkit keeps optimizer "
                             "state in fp32")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
