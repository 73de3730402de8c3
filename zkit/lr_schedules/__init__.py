"""Built-in plugin: learning-rate schedules (DeepSpeed's ``scheduler`` section), registered by
:mod:`zkit.lr_schedules.plugin`."""
from __future__ import annotations

from zkit.lr_schedules.warmup import LRRangeTest, LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zkit.lr_schedules.one_cycle import OneCycle

__all__ = ["LRRangeTest", "LRSchedule", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
