"""DeepSpeed's learning-rate schedules with DeepSpeed's parameter names and formulas:
``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``LRRangeTest`` (``OneCycle`` lives in
:mod:`zkit.lr_schedules.one_cycle`).

Every schedule is a pure function of the iteration, ``lr_at(i)``; ``step()`` advances
``last_batch_iteration`` by one (or to the value given) and writes ``lr_at`` into each param group.
Construction writes ``lr_at(last_batch_iteration)``, which for a fresh schedule
(``last_batch_iteration=-1``) is the value DeepSpeed writes at construction: ``warmup_min_lr``
for the warmup schedules, ``0`` for ``WarmupCosineLR``, the minimum for ``OneCycle`` and
``LRRangeTest``. The engine calls ``step()`` after every optimizer step, so optimizer step ``k``
(counting from 1) runs with ``lr_at(k - 2)``, exactly as under DeepSpeed.

Where DeepSpeed only logs a warning (unknown ``warmup_type``, ``total_num_steps`` below
``warmup_num_steps``) these classes raise, naming the parameter.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from zkit.core.config import params as check

WARMUP_TYPES = ("log", "linear")


class LRSchedule:
    """Shared machinery: param-group bookkeeping, ``step``, ``get_last_lr`` and state dicts.

    Subclasses implement :meth:`lr_at` (and :meth:`_momentum_at` to drive momentum).
    """

    name = "LRSchedule"

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        inner = getattr(optimizer, "optimizer", None)
        if not hasattr(optimizer, "param_groups") and inner is not None:
            optimizer = inner  # an engine-level optimizer wrapper
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{self.owner}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.last_batch_iteration = check.integer(self.owner, "last_batch_iteration", last_batch_iteration, low=-1)
        self._last_lr: list[float] = []

    @property
    def owner(self) -> str:
        return f"scheduler {self.name!r}"

    @property
    def n_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def _per_group(self, key: str, value: Any, **bounds: Any) -> list[float]:
        return check.per_group(self.owner, key, value, self.n_groups,
                               lambda o, k, v: check.number(o, k, v, **bounds))

    # -- the schedule -----------------------------------------------------------------------
    def lr_at(self, iteration: int) -> list[float]:
        """The learning rate of every param group after ``iteration`` (-1 = before the first)."""
        raise NotImplementedError

    def _momentum_at(self, iteration: int) -> list[float] | None:
        return None

    def get_lr(self) -> list[float]:
        """The learning rates for the current ``last_batch_iteration``."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and apply it."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = check.integer(self.owner, "last_batch_iteration", last_batch_iteration, low=-1)
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr (fused/capturable optimizers) a tensor
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)
        moms = self._momentum_at(self.last_batch_iteration)
        if moms is not None:
            for group, mom in zip(self.optimizer.param_groups, moms):
                if "betas" in group:
                    group["betas"] = (mom, group["betas"][1])
                else:
                    group["momentum"] = mom

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"last_batch_iteration": i}`` (DeepSpeed's format) plus what a subclass read from
        the optimizer at construction."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the iteration (a DeepSpeed state dict works too) and re-apply its lr."""
        if "last_batch_iteration" not in state:
            raise ValueError(f"{self.owner}: state dict has no 'last_batch_iteration' (keys: {sorted(state)})")
        self.last_batch_iteration = check.integer(
            self.owner, "last_batch_iteration", state["last_batch_iteration"], low=-1)
        self._apply()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


def _warmup_gamma(warmup_type: str, iteration: int, warmup_steps: int, inv_log: float) -> float:
    """Fraction of the warmup done after ``iteration`` (< warmup_steps): log or linear."""
    if warmup_type == "log":
        return inv_log * math.log(iteration + 1)
    return iteration / warmup_steps


class WarmupLR(LRSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``gamma(i) = ln(i + 1) / ln(W)`` (``log``) or ``i / W`` (``linear``) for ``i < W``, else 1;
    ``lr = min + (max - min) gamma``, with ``W = max(2, warmup_num_steps)``. ``warmup_max_lr``
    defaults to each param group's lr. Min and max may be lists, one value per param group.
    """

    name = "WarmupLR"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_warmup(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        self._apply()

    def _init_warmup(self, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type) -> None:
        self.warmup_num_steps_given = check.integer(self.owner, "warmup_num_steps", warmup_num_steps, low=1)
        self.warmup_num_steps = max(2, self.warmup_num_steps_given)
        self.warmup_type = check.choice(self.owner, "warmup_type", warmup_type, WARMUP_TYPES)
        self._inv_log = 1.0 / math.log(self.warmup_num_steps)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = self._per_group("warmup_min_lr", warmup_min_lr, low=0.0)
        self.max_lrs = self._per_group("warmup_max_lr", warmup_max_lr, low=0.0)
        for i, (lo, hi) in enumerate(zip(self.min_lrs, self.max_lrs)):
            if hi < lo:
                raise ValueError(
                    f"{self.owner}: warmup_max_lr ({hi:g}) is below warmup_min_lr ({lo:g})"
                    + (f" for param group {i}" if self.n_groups > 1 else "")
                )

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return _warmup_gamma(self.warmup_type, i, self.warmup_num_steps, self._inv_log)
        return 1.0

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def state_dict(self) -> dict[str, Any]:
        # max_lrs may have come from the optimizer, whose lr the schedule then overwrote.
        return {**super().state_dict(), "warmup_max_lr": list(self.max_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "warmup_max_lr" in state:
            self.max_lrs = self._per_group("warmup_max_lr", state["warmup_max_lr"], low=0.0)
        super().load_state_dict(state)


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``:
    ``gamma(i) = max(0, (T - i) / max(1, T - W))`` for ``i >= W``.

    ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's default for this schedule).
    """

    name = "WarmupDecayLR"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        LRSchedule.__init__(self, optimizer, last_batch_iteration)
        self.total_num_steps = check.integer(self.owner, "total_num_steps", total_num_steps, low=1)
        self._init_warmup(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        if self.total_num_steps < self.warmup_num_steps_given:
            raise ValueError(
                f"{self.owner}: total_num_steps ({self.total_num_steps}) is less than "
                f"warmup_num_steps ({self.warmup_num_steps_given})"
            )
        self._apply()

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return _warmup_gamma(self.warmup_type, i, self.warmup_num_steps, self._inv_log)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - i) / span)


class WarmupCosineLR(LRSchedule):
    """Scale each param group's lr (read at construction) by a ratio that warms up from
    ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` (log or linear), then follows a half
    cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stays there.

    For ``i >= W``: ``p = min(1, (i - W + 1) / max(1, T - W))``,
    ``ratio = cos_min_ratio + (1 - cos_min_ratio) (1 + cos(pi p)) / 2``.
    """

    name = "WarmupCosineLR"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        o = self.owner
        self.total_num_steps = check.integer(o, "total_num_steps", total_num_steps, low=1)
        given = check.integer(o, "warmup_num_steps", warmup_num_steps, low=1)
        if self.total_num_steps < given:
            raise ValueError(f"{o}: total_num_steps ({self.total_num_steps}) is less than warmup_num_steps ({given})")
        self.warmup_num_steps = max(2, given)
        self.warmup_min_ratio = check.number(o, "warmup_min_ratio", warmup_min_ratio, low=0.0, high=1.0)
        self.cos_min_ratio = check.number(o, "cos_min_ratio", cos_min_ratio, low=0.0, high=1.0)
        self.warmup_type = check.choice(o, "warmup_type", warmup_type, WARMUP_TYPES)
        self._inv_log = 1.0 / math.log(self.warmup_num_steps)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._apply()

    def lr_ratio_at(self, i: int) -> float:
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(self.warmup_type, i, self.warmup_num_steps, self._inv_log)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio_at(iteration)
        return [lr * ratio for lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # The base lrs were read from the optimizer, whose lr the schedule then overwrote: a
        # schedule rebuilt on a restored optimizer must not read them again.
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "base_lrs" in state:
            self.base_lrs = self._per_group("base_lrs", state["base_lrs"], low=0.0)
        super().load_state_dict(state)


class LRRangeTest(LRSchedule):
    """Grow the lr from ``lr_range_test_min_lr``:
    ``lr = min_lr (1 + rate * (i + 1) / step_size)``, with ``floor`` on ``(i + 1) / step_size``
    when ``lr_range_test_staircase``. Used to find the largest lr that still trains."""

    name = "LRRangeTest"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        o = self.owner
        self.min_lrs = self._per_group("lr_range_test_min_lr", lr_range_test_min_lr, low=0.0)
        self.step_size = check.integer(o, "lr_range_test_step_size", lr_range_test_step_size, low=1)
        self.step_rate = check.number(o, "lr_range_test_step_rate", lr_range_test_step_rate, low=0.0)
        self.staircase = check.boolean(o, "lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def lr_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1.0 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]
