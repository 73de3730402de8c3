"""``deepspeed.runtime.lr_schedules``: DeepSpeed's LR schedules (:mod:`zkit.optim.lr_schedules`)."""
from zkit.optim.lr_schedules import LRRangeTest, LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zkit.optim.one_cycle import OneCycle

#: the schedule names a config's ``scheduler.type`` may take (transformers reads this)
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["LRRangeTest", "LRSchedule", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR",
           "WarmupLR"]
