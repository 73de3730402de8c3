"""zkit's own optimizer and learning-rate schedule classes (the built-in plugins
:mod:`zkit.builtin.optim_torch` and :mod:`zkit.builtin.schedules` register them by name)."""
from __future__ import annotations

from zkit.optim.lamb import Lamb
from zkit.optim.lr_schedules import LRRangeTest, LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zkit.optim.one_cycle import OneCycle

__all__ = ["Lamb", "LRRangeTest", "LRSchedule", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
