"""Config keys DeepSpeed accepts and ignores where they have no effect, which ``deepspeed.initialize``
then ignores too, with one warning naming the key, rather than refuse as ``zkit.initialize`` does.

``zero_optimization.offload_param`` below stage 3: DeepSpeed offloads parameters only at stage 3
and trains stages 0-2 as if the key were absent (its losses with the key are bit-equal to those
without). DeepSpeed-Chat's ``--offload`` writes it at every stage."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from deepspeed.utils.logging import logger
from zkit.core.config import read_config_file

_WARNED: set[str] = set()


def drop_ignored_keys(config: Any) -> Any:
    """``config`` (a dict or a JSON file's path, read as ``zkit.initialize`` reads it: a bad file is
    a ``ConfigError`` naming it) without the keys DeepSpeed ignores."""
    data = read_config_file(Path(config)) if isinstance(config, (str, os.PathLike)) else config
    if not isinstance(data, Mapping):
        return config
    zero = data.get("zero_optimization")
    offload = zero.get("offload_param") if isinstance(zero, Mapping) else None
    device = offload.get("device") if isinstance(offload, Mapping) else None
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if device in (None, "none") or not isinstance(stage, int) or stage >= 3:
        return data
    key = "zero_optimization.offload_param"
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(f"config key '{key}' (device {device!r}) has no effect at ZeRO stage {stage}: DeepSpeed "
                       "offloads parameters only at stage 3 and ignores the key below it, and so does this drop-in; "
                       "remove it, or set zero_optimization.stage to 3")
    return {**data, "zero_optimization": {k: v for k, v in zero.items() if k != "offload_param"}}
