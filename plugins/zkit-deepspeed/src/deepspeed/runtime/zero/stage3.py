"""``deepspeed.runtime.zero.stage3``: ``unwrap_model_for_generation`` and the name of DeepSpeed's
ZeRO-3 optimizer wrapper (refused when built, as ``stage_1_and_2.DeepSpeedZeroOptimizer``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from deepspeed.runtime.zero.stage_1_and_2 import _EngineBuilt
from zkit.zero import GatheredParameters

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]


class DeepSpeedZeroOptimizer_Stage3(_EngineBuilt):  # noqa: N801 - DeepSpeed's name
    """Refused when built."""

    _what = "DeepSpeed's ZeRO-3 optimizer wrapper"


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Gather every parameter of an engine (or module) once for the block, so generation's many
    forwards run without a gather each; yields ``model``. DeepSpeed also removes its ZeRO-3
    hooks here; zkit's hooks do nothing outside the engine's own forward, so none are removed."""
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):
        yield model
