"""The protocol of an optimizer whose step fuses what the partitioner would otherwise do in
separate passes over the gradients and weights.

An optimizer satisfying :class:`FusedStepOptimizer` (zkit-offload's CPU optimizers do) gets, from
the ZeRO partitioner:

* ``fused_step(grad_factor=f)`` instead of ``grad.mul_(f)`` then ``step()``: loss-scale unscaling
  and clipping are one number the kernel multiplies each gradient by as it reads it;
* ``attach_copy_out(master, twin)`` once per owned piece when the training weights are fp16/bf16
  buffers in host memory: the step writes each updated master element into its 16-bit twin in the
  same pass, so no separate copy of the master into the parameters follows.

``fuses`` says whether the optimizer wants this (zkit-offload's ``backend="torch"`` does not: it
runs torch's kernel after the separate passes, the reference the fused pass is measured against);
``last_kernel`` names what the last step ran, for the step log.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class FusedStepOptimizer(Protocol):
    fuses: bool
    last_kernel: str

    def fused_step(self, grad_factor: float = 1.0, check_overflow: bool = False) -> bool: ...

    def attach_copy_out(self, param: torch.Tensor, target: torch.Tensor | None) -> None: ...
