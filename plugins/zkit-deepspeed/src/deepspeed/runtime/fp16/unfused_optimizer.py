"""``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer``: refused when built."""
from deepspeed.runtime.zero.stage_1_and_2 import _EngineBuilt

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(_EngineBuilt):  # noqa: N801 - DeepSpeed's name
    """Refused when built: the engine does mixed precision from the config's fp16/bf16 sections."""

    _what = "DeepSpeed's FP16 optimizer wrapper"
