"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (zkit-offload's CPU Adam, DeepSpeed's signature
and defaults) and ``FusedAdam`` (torch's fused Adam/AdamW). ``DeepSpeedCPUAdam`` is imported when
first used, so that ``import deepspeed`` works without zkit-offload (an optional dependency), as
DeepSpeed's works without its CPU Adam extension built."""
from __future__ import annotations

import importlib
from typing import Any

from deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedCPUAdam":
        return importlib.import_module("deepspeed.ops.adam.cpu_adam").DeepSpeedCPUAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
