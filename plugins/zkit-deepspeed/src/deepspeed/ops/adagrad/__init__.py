"""``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``: zkit-offload's CPU Adagrad with DeepSpeed's signature
and defaults (``lr=1e-2, eps=1e-10, weight_decay=0``; no learning-rate decay, sums from 0)."""
from __future__ import annotations

from typing import Any, Iterable

from zkit_deepspeed.optional import import_plugin

CPUAdagrad = import_plugin("zkit_offload.cpu_adagrad", "deepspeed.ops.adagrad").CPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """``amsgrad=True`` and ``fp32_optimizer_states=False`` are refused (DeepSpeed's kernel has no
    AMSGrad either; zkit keeps optimizer state in fp32)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported (DeepSpeed's kernel has none either)")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad(fp32_optimizer_states=False) is not supported: zkit keeps optimizer "
                             "state in fp32")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
