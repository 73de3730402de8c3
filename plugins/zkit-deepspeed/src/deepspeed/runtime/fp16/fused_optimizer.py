"""``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer``: refused when built."""
from deepspeed.runtime.zero.stage_1_and_2 import _EngineBuilt

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(_EngineBuilt):  # noqa: N801 - DeepSpeed's name
    """Refused when built: the engine does mixed precision from the config's fp16/bf16 sections."""

    _what = "DeepSpeed's FP16 optimizer wrapper"
