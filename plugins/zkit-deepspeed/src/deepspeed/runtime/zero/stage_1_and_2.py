"""``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer``, DeepSpeed's ZeRO-1/2 optimizer
wrapper. zkit's engine partitions the optimizer itself (``engine.optimizer`` is a torch optimizer
over this rank's shards, not an instance of this class): the class is here for imports and
``isinstance`` checks, and building one is refused."""
from __future__ import annotations

from typing import Any

from deepspeed.refused import FeatureNotProvided

__all__ = ["DeepSpeedZeroOptimizer"]


class _EngineBuilt:
    _what = "DeepSpeed's ZeRO-1/2 optimizer wrapper"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise FeatureNotProvided(
            f"{type(self).__name__} ({self._what}) is not built directly with zkit: deepspeed.initialize(..., "
            f"config=...) builds the optimizer from the config's zero_optimization, fp16 and bf16 sections; read "
            f"its state with deepspeed.utils.safe_get_full_optimizer_state", name=type(self).__name__)


class DeepSpeedZeroOptimizer(_EngineBuilt):
    """Refused when built (see the module docstring)."""
