"""``deepspeed.ops.adam.FusedAdam`` over torch's Adam with ``fused=True`` where torch has the
kernel for the parameters' device and dtype (else ``foreach``)."""
from __future__ import annotations

from typing import Any, Iterable

import torch


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's signature: ``adam_w_mode=True`` (its default) is AdamW's decoupled decay,
    ``False`` Adam's L2 decay. ``bias_correction=False`` and ``amsgrad=True`` are refused, as
    DeepSpeed's kernel refuses amsgrad (torch's Adam always corrects the bias)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not supported: torch's Adam kernels always "
                             "correct the moments' bias")
        params = list(params)
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        fused = bool(tensors) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in tensors)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, fused=fused or None, foreach=None if fused else True)
        # kept where the engine's rebuild over the shards reads the constructor's arguments
        self.defaults.update(adam_w_mode=adam_w_mode, bias_correction=bias_correction, set_grad_none=set_grad_none)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
