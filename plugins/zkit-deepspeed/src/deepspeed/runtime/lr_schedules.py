"""``deepspeed.runtime.lr_schedules``: DeepSpeed's LR schedules (:mod:`zkit.lr_schedules.warmup`)
and its constants (the schedule names, ``VALID_LR_SCHEDULES`` that transformers reads, and the
``scheduler.params`` keys)."""
from deepspeed.runtime.lr_schedule_keys import *  # noqa: F401,F403
from deepspeed.runtime.lr_schedule_keys import __all__ as _keys
from zkit.lr_schedules import LRRangeTest, LRSchedule, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "LRSchedule", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", *_keys]
