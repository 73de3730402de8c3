"""Built-in plugin: learning-rate schedules (DeepSpeed's ``scheduler`` section), registered by
:mod:`zkit.schedules.plugin`."""
from __future__ import annotations

from zkit.schedules.lr_schedules import LRRangeTest, LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zkit.schedules.one_cycle import OneCycle

__all__ = ["LRRangeTest", "LRSchedule", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
