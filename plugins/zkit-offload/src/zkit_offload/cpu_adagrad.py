"""``CPUAdagrad``: ``torch.optim.Adagrad`` on fp32 host buffers in one fused Numba pass.

Same hyper-parameters and ``state_dict`` names as torch (``"step"``, ``"sum"``), so checkpoints
move between the two.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from zkit_offload import kernels
from zkit_offload.cpu_optimizer import FusedCPUOptimizer, f32, launch


class CPUAdagrad(FusedCPUOptimizer):
    """Adagrad over fp32 CPU parameters (``lr / (1 + (step-1)*lr_decay)``, L2 ``weight_decay``
    added to the gradient, ``sum`` started at ``initial_accumulator_value``), like torch."""

    _state_names = ("sum",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        for key in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            if not float(group[key]) >= 0.0:
                raise ValueError(f"CPUAdagrad: invalid {key} {group[key]} (must be >= 0)")
        self._check_flags(group, "CPUAdagrad")

    def _init_state(self, group, p, state) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["sum"] = torch.full_like(p, float(group["initial_accumulator_value"]),
                                       memory_format=torch.contiguous_format)

    def _update(self, group, p, state, out, out_kind, grad_factor) -> None:
        step = self.step_count(state)
        clr = float(group["lr"]) / (1.0 + (step - 1.0) * float(group["lr_decay"]))
        launch(
            kernels.adagrad_update,
            self.array(p), self.grad_array(p), self.array(state["sum"]), out, out_kind,
            f32(clr), f32(group["eps"]), f32(group["weight_decay"]), grad_factor,
        )
