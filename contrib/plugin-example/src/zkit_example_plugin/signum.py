"""Signum (Bernstein et al., 2018): SGD on the sign of the momentum."""
from __future__ import annotations

import torch


class Signum(torch.optim.Optimizer):
    """p -= lr * sign(m), m = momentum * m + (1 - momentum) * grad; decoupled weight decay.

    Elementwise: each element's update depends on that element only, so ZeRO can step it on any
    shard of a parameter (``OptimizerRecord(elementwise=True)``)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ValueError(f"Signum: lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Signum: momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            grads = [p.grad for p in params]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads, alpha=1 - group["momentum"])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, torch._foreach_sign(bufs), alpha=-group["lr"])
        return loss
