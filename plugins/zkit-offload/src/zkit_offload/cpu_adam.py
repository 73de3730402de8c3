"""``CPUAdam`` / ``CPUAdamW``: Adam on fp32 host buffers in one fused Numba pass.

Drop-in for ``torch.optim.Adam`` / ``AdamW`` (same hyper-parameters, same ``state_dict`` names
``"step"``, ``"exp_avg"``, ``"exp_avg_sq"``, so a checkpoint moves between them) and for
DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode``, ``bias_correction``), without a C++ build.

``backend``: ``"numba"`` always runs the fused kernel; ``"torch"`` runs torch's fused CPU kernel
for steps with nothing to fuse (no ``grad_factor``, no copy-out) and the Numba kernel otherwise,
and tells the engine not to fuse (it then scales and copies in separate passes around torch's kernel);
``"auto"`` (default) picks, for that plain step, whichever was faster in ``contrib/bench/bench_cpu_adam.py``
on the reference machine: torch's (by 3-4%, within noise; the Numba kernel wins once there is
anything to fuse). Both compute the same fp32 formula.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch

from zkit_offload import kernels
from zkit_offload.cpu_optimizer import FusedCPUOptimizer, f32, launch

BACKENDS = ("auto", "numba", "torch")
#: The backend ``"auto"`` uses for a plain fp32 step (see the module docstring).
AUTO_PLAIN_BACKEND = "torch"


class CPUAdam(FusedCPUOptimizer):
    """Adam (``adamw_mode=False``, L2 decay added to the gradient, like ``torch.optim.Adam``) or
    AdamW (``adamw_mode=True``, decoupled decay) over fp32 CPU parameters.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.Adam``.
        amsgrad: not supported (``True`` is an error).
        adamw_mode: decoupled weight decay (AdamW). Also read from a group's
            ``decoupled_weight_decay`` (torch's name), so torch state dicts load unchanged.
        bias_correction: Adam's bias correction (DeepSpeed lets it be turned off).
        backend: ``"auto"``, ``"numba"`` or ``"torch"`` (see the module docstring).
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _name = "CPUAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        adamw_mode: bool = False,
        bias_correction: bool = True,
        backend: str = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"{self._name}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        #: ``backend="torch"``: the engine scales gradients and copies weights in passes of its own
        #: around torch's kernel (the unfused reference of contrib/bench/bench_offload_step.py)
        self.fuses = backend != "torch"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = self._name
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        betas = group["betas"]
        if not lr >= 0.0:
            raise ValueError(f"{name}: invalid learning rate {lr} (must be >= 0)")
        if not eps >= 0.0:
            raise ValueError(f"{name}: invalid eps {eps} (must be >= 0)")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{name}: invalid betas {tuple(betas)} (each must be in [0, 1))")
        if not wd >= 0.0:
            raise ValueError(f"{name}: invalid weight_decay {wd} (must be >= 0)")
        if group.get("amsgrad"):
            raise ValueError(f"{name} does not support amsgrad=True")
        self._check_flags(group, name)

    def _update(self, group, p, state, out, out_kind, grad_factor) -> None:
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        wd = float(group["weight_decay"])
        decoupled = bool(group.get("decoupled_weight_decay", False))
        step = self.step_count(state)
        if group.get("bias_correction", True):
            bias1, bias2_sqrt = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
        else:
            bias1, bias2_sqrt = 1.0, 1.0
        launch(
            kernels.adam_update,
            self.array(p), self.grad_array(p), self.array(state["exp_avg"]), self.array(state["exp_avg_sq"]), out, out_kind,
            f32(lr), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(group["eps"]),
            f32(0.0 if decoupled else wd), f32(1.0 - lr * wd if decoupled else 1.0),
            f32(bias1), f32(bias2_sqrt), grad_factor,
        )

    def _steps_together(self, group: dict[str, Any], grad_factor: np.float32) -> bool:
        return self._torch_plain(kernels.OUT_NONE, grad_factor, group)

    def _update_together(self, group: dict[str, Any], members: list[tuple[torch.Tensor, dict[str, Any]]],
                         grad_factor: np.float32) -> None:
        """A plain step of the whole group in one call of torch's fused multi-tensor kernel (the
        same per-element formula as one call per parameter)."""
        fused = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
        self.last_kernel = f"torch.{fused.__name__} (a plain fp32 step: nothing to fuse; one call per group)"
        beta1, beta2 = group["betas"]
        fused([p for p, _ in members], [p.grad for p, _ in members], [s["exp_avg"] for _, s in members],
              [s["exp_avg_sq"] for _, s in members], [], [s["step"] for _, s in members],
              lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=float(group["weight_decay"]),
              eps=group["eps"], amsgrad=False, maximize=False)

    def _torch_plain(self, out_kind: int, grad_factor: np.float32, group: dict[str, Any]) -> bool:
        backend = AUTO_PLAIN_BACKEND if self.backend == "auto" else self.backend
        return (backend == "torch" and out_kind == kernels.OUT_NONE and grad_factor == 1.0
                and group.get("bias_correction", True))


class CPUAdamW(CPUAdam):
    """:class:`CPUAdam` with decoupled weight decay; defaults as ``torch.optim.AdamW``."""

    _name = "CPUAdamW"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adamw_mode=True,
                         bias_correction=bias_correction, backend=backend)
