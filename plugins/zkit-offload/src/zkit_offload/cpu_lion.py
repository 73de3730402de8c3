"""``CPULion``: the Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization
Algorithms") on fp32 host buffers in one fused Numba pass. State: ``"step"``, ``"exp_avg"``."""
from __future__ import annotations

from typing import Any, Iterable

from zkit_offload import kernels
from zkit_offload.cpu_optimizer import FusedCPUOptimizer, f32, launch


class CPULion(FusedCPUOptimizer):
    """Lion: ``p = p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g)``, then ``m = b2*m + (1-b2)*g``."""

    _state_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _check_group(self, group: dict[str, Any]) -> None:
        if not float(group["lr"]) >= 0.0:
            raise ValueError(f"CPULion: invalid learning rate {group['lr']} (must be >= 0)")
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"CPULion: invalid betas {tuple(betas)} (each must be in [0, 1])")
        if not float(group["weight_decay"]) >= 0.0:
            raise ValueError(f"CPULion: invalid weight_decay {group['weight_decay']} (must be >= 0)")
        self._check_flags(group, "CPULion")

    def _update(self, group, p, state, out, out_kind, grad_factor) -> None:
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        launch(
            kernels.lion_update,
            self.array(p), self.grad_array(p), self.array(state["exp_avg"]), out, out_kind,
            f32(lr), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(1.0 - lr * float(group["weight_decay"])), grad_factor,
        )
