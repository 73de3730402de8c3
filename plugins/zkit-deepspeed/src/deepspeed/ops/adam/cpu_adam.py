"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: zkit-offload's :class:`~zkit_offload.CPUAdam` with
DeepSpeed's signature and defaults (``adamw_mode=True``: decoupled decay). Needs zkit-offload,
as DeepSpeed's needs its CPU Adam extension."""
from __future__ import annotations

from typing import Any, Iterable

from zkit_deepspeed.optional import import_plugin

CPUAdam = import_plugin("zkit_offload.cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam").CPUAdam


class DeepSpeedCPUAdam(CPUAdam):
    """``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)``.
    ``fp32_optimizer_states=False`` (state in the parameters' dtype) is refused: zkit keeps the
    optimizer state in fp32."""

    _name = "DeepSpeedCPUAdam"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: zkit keeps optimizer "
                             "state in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)
        self.defaults.update(adamw_mode=adamw_mode, bias_correction=bias_correction)
