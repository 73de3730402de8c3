"""DeepSpeed's ``OneCycle`` schedule (Smith, "A disciplined approach to neural network
hyper-parameters", arXiv:1803.09820): one triangular cycle of the lr between ``cycle_min_lr`` and
``cycle_max_lr`` (momentum moving the opposite way), then an optional decay.

With ``F = cycle_first_step_size``, ``S = cycle_second_step_size`` (default ``F``) and
``n = i + 1`` for iteration ``i``, the cycle's scale factor is DeepSpeed's::

    x = n / (F + S) - floor(n / (F + S))
    scale = x / r if x <= r else (x - 1) / (r - 1),        r = F / (F + S)
    with a stair count c > 0 on that half: scale = floor(pos * c) / c,
        pos = (n mod (F + S)) / F on the way up, (F + S - n mod (F + S)) / S on the way down

    lr  = min_lr + (max_lr - min_lr) scale               for i < F + S
    mom = max_mom - (max_mom - min_mom) scale

After the cycle (``i >= F + S``, ``k = i - F - S + 1``): ``lr = min_lr / (1 + decay_lr_rate k /
decay_step_size)`` and ``mom = max_mom (1 + decay_mom_rate k / decay_step_size)``; a zero
``decay_step_size`` or rate holds ``min_lr`` / ``max_mom``. (The momentum grows after the cycle,
as in DeepSpeed; reaching 1 is an error.)

Momentum is the first beta of Adam-like optimizers (the second is left as the group has it) or
SGD's ``momentum``. Two deliberate differences from DeepSpeed, which sets ``betas = (mom, 0.99)``
and starts at ``cycle_min_mom``: the group's second beta is kept, and construction applies the
formula's own start value, ``cycle_max_mom`` (high momentum with the low lr).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from zkit.core.config import params as check
from zkit.lr_schedules.warmup import LRSchedule


class OneCycle(LRSchedule):
    """The 1cycle policy; see the module docstring for the formulas.

    ``cycle_momentum=None`` (the default) cycles momentum when the optimizer has one (``betas``
    or ``momentum``); ``True`` on an optimizer without momentum is an error.
    """

    name = "OneCycle"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool | None = None,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        o = self.owner
        self.first_step_size = check.integer(o, "cycle_first_step_size", cycle_first_step_size, low=1)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None
            else check.integer(o, "cycle_second_step_size", cycle_second_step_size, low=0)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = check.integer(o, "cycle_first_stair_count", cycle_first_stair_count, low=0)
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None
            else check.integer(o, "cycle_second_stair_count", cycle_second_stair_count, low=0)
        )
        self.decay_step_size = check.integer(o, "decay_step_size", decay_step_size, low=0)

        self.min_lrs = self._per_group("cycle_min_lr", cycle_min_lr, low=0.0)
        self.max_lrs = self._per_group("cycle_max_lr", cycle_max_lr, low=0.0)
        self._check_order("cycle_min_lr", self.min_lrs, "cycle_max_lr", self.max_lrs)
        self.decay_lr_rate = check.number(o, "decay_lr_rate", decay_lr_rate, low=0.0)

        has_momentum = all("betas" in g or "momentum" in g for g in self.optimizer.param_groups)
        if cycle_momentum is None:
            cycle_momentum = has_momentum
        elif check.boolean(o, "cycle_momentum", cycle_momentum) and not has_momentum:
            raise ValueError(
                f"{o}: cycle_momentum=true but {type(self.optimizer).__name__} has neither 'betas' "
                f"nor 'momentum' in its param groups; set cycle_momentum=false"
            )
        self.cycle_momentum = cycle_momentum
        self.min_moms = self._per_group("cycle_min_mom", cycle_min_mom, low=0.0, high=1.0, high_open=True)
        self.max_moms = self._per_group("cycle_max_mom", cycle_max_mom, low=0.0, high=1.0, high_open=True)
        self._check_order("cycle_min_mom", self.min_moms, "cycle_max_mom", self.max_moms)
        self.decay_mom_rate = check.number(o, "decay_mom_rate", decay_mom_rate, low=0.0)
        self._apply()

    def _check_order(self, lo_key: str, los: list[float], hi_key: str, his: list[float]) -> None:
        for lo, hi in zip(los, his):
            if lo > hi:
                raise ValueError(f"{self.owner}: {lo_key} ({lo:g}) is above {hi_key} ({hi:g})")

    def scale_at(self, iteration: int) -> float:
        """Position in the cycle after ``iteration``: 0 at the ends, 1 at the peak."""
        n = iteration + 1
        cycle = math.floor(1 + n / self.total_size)
        x = 1.0 + n / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # From the integer offset, not from `scale`: a float scale a hair under a stair
            # boundary would drop a whole stair (even off the peak).
            offset = n % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(iteration)
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, iteration: int) -> list[float]:
        """The momentum (first beta) of every param group after ``iteration``."""
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(iteration)
        moms = [hi * factor for hi in self.max_moms]
        if max(moms) >= 1.0:
            # DeepSpeed's post-cycle momentum grows without bound; a beta >= 1 makes the
            # optimizer diverge silently, so stop here instead.
            raise ValueError(
                f"{self.owner}: momentum reached {max(moms):g} >= 1 at iteration {iteration}; "
                f"lower decay_mom_rate ({self.decay_mom_rate:g}) or raise decay_step_size"
            )
        return moms

    def _momentum_at(self, iteration: int) -> list[float] | None:
        return self.momentum_at(iteration) if self.cycle_momentum else None
