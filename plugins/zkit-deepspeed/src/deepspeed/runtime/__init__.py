"""``deepspeed.runtime``. Its submodules are imported with it, as DeepSpeed's ``import deepspeed``
does, because libraries reach them as attributes (Accelerate reads
``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after a bare ``import deepspeed``)."""
from deepspeed.runtime import activation_checkpointing, config, engine, lr_schedules, utils, zero

__all__ = ["activation_checkpointing", "config", "engine", "lr_schedules", "utils", "zero"]
