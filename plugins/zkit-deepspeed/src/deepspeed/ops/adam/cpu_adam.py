"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: zkit-offload's :class:`~zkit_offload.CPUAdam` with
DeepSpeed's signature and defaults (``adamw_mode=True``: decoupled decay). Needs zkit-offload,
as DeepSpeed's needs its CPU Adam extension.

Like DeepSpeed's, it takes fp16 and bf16 parameters: under ``zero.Init`` with bf16 the model's
parameters are bf16 before the optimizer is built. Under ``deepspeed.initialize`` the engine
steps its fp32 master instead; stepped directly, a 16-bit parameter is updated as DeepSpeed's
kernel does it: read in fp32, stepped with fp32 state, written back rounded."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

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

    def _check_param(self, p: torch.Tensor, layout: bool = True) -> None:
        if p.dtype in _HALF and p.device.type == "cpu":
            return  # stepped through an fp32 copy (step)
        super()._check_param(p, layout)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        half = [(p, p.data, p.grad) for g in self.param_groups for p in g["params"]
                if p.dtype in _HALF and p.grad is not None]
        for p, data, grad in half:
            p.data = data.to(torch.float32, memory_format=torch.contiguous_format)
            p.grad = grad.to(torch.float32, memory_format=torch.contiguous_format)
        try:
            super().step(**kwargs)
        finally:
            for p, data, grad in half:
                data.copy_(p.data)
                p.data = data
                p.grad = grad
        return loss


_HALF = (torch.float16, torch.bfloat16)
