"""zkit's built-in learning-rate schedules: DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``,
``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest``, selected by
``"scheduler": {"type": name, "params": {...}}`` (names are case-insensitive)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

import zkit
from zkit.core.config import params as check
from zkit.lr_schedules.warmup import LRRangeTest, LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zkit.lr_schedules.one_cycle import OneCycle
from zkit.core.records import SchedulerRecord


def schedule_factory(cls: type[LRSchedule]) -> Callable[..., LRSchedule]:
    """``factory(optimizer, **params)`` for a schedule class: unknown keys get the closest valid
    name, missing required keys are named, before the class sees them."""
    sig = inspect.signature(cls.__init__)
    names = [n for n in sig.parameters if n not in ("self", "optimizer")]
    required = [n for n in names if sig.parameters[n].default is inspect.Parameter.empty]

    def factory(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedule:
        check.check_known("scheduler", cls.name, params, names)
        missing = [n for n in required if n not in params]
        if missing:
            raise ValueError(
                f"scheduler {cls.name!r} needs parameter{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(repr, missing))}"
            )
        return cls(optimizer, **params)

    factory.__name__ = f"make_{cls.name}"
    factory.__doc__ = f"Build :class:`{cls.__module__}.{cls.__name__}` from a config's params."
    return factory


_SCHEDULES: list[tuple[type[LRSchedule], str]] = [
    (WarmupLR, "warm up from warmup_min_lr to warmup_max_lr (log or linear), then hold"),
    (WarmupDecayLR, "WarmupLR, then linear decay to 0 at total_num_steps"),
    (WarmupCosineLR, "warm up the lr ratio, then cosine decay to cos_min_ratio"),
    (OneCycle, "one lr/momentum cycle, then optional decay (1cycle policy)"),
    (LRRangeTest, "grow the lr step by step to find the largest that trains"),
]


@zkit.hookimpl(trylast=True)
def zkit_register_schedulers():
    for cls, description in _SCHEDULES:
        yield SchedulerRecord(name=cls.name, kind="lr", factory=schedule_factory(cls), description=description)
