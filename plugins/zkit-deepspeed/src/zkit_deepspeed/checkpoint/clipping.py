"""The gradient clipping a DeepSpeed run trained with, compared with the engine that continues it.

DeepSpeed reads ``gradient_clipping`` from its config at every start, a resume included, and an
absent key means its version's default: no clipping before 0.19.3, a norm of 1.0 from 0.19.3 on
(deepspeedai/DeepSpeed#8068). zkit's default is 0 (off). So one config dict without the key clips
in DeepSpeed 0.19.8 and not in zkit, and a run continued from DeepSpeed's checkpoint would quietly
take other steps than DeepSpeed's own resume (on a model whose gradient norm exceeds 1, the first
step already). The model file records the run's config (``ds_config``) and DeepSpeed's version
(``ds_version``): a load refuses when the two clip differently and this engine's config does not
set ``gradient_clipping`` itself. A config that sets it is a choice, honoured as DeepSpeed's resume
honours it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zkit.core.checkpoint_errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

#: the first DeepSpeed release whose default ``gradient_clipping`` is 1.0 (0 before)
CLIPS_BY_DEFAULT_FROM = (0, 19, 3)
DEFAULT_NORM = 1.0


def deepspeeds_clipping(model_state: dict[str, Any]) -> tuple[float, str] | None:
    """The norm the DeepSpeed run clipped gradients at (0: none) and where that value came from;
    ``None`` when the model file does not say (no config dict, no version, a value not a number)."""
    config = model_state.get("ds_config")
    if not isinstance(config, dict):  # a JSON path, or a save without it
        return None
    if "gradient_clipping" in config:
        value = config["gradient_clipping"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value), f'its config sets "gradient_clipping": {value}'
    version = _release(model_state.get("ds_version"))
    if version is None:
        return None
    default = DEFAULT_NORM if version >= CLIPS_BY_DEFAULT_FROM else 0.0
    return default, f"DeepSpeed {model_state['ds_version']}'s default: its config does not set gradient_clipping"


def check_clipping(engine: "Engine", model_state: dict[str, Any], where: Path) -> None:
    """Refuse to continue without clipping a run DeepSpeed clipped, unless this engine's config
    chose its ``gradient_clipping``. Every rank reads the same model file and the
    same config, so every rank reaches the same verdict."""
    ran = deepspeeds_clipping(model_state)
    if ran is None or engine.config.get("gradient_clipping") is not None:
        return
    norm, why = ran
    if norm == engine.config.gradient_clipping:  # zkit's default, 0: a run DeepSpeed did not clip
        return
    raise CheckpointError(
        f"{where}: the DeepSpeed run clipped the gradient norm at {norm!r} ({why}); this engine does not clip "
        f"(zkit's default gradient_clipping is 0), so the run would not continue as DeepSpeed's own resume does. "
        f'Set "gradient_clipping": {norm!r} in the config to continue as DeepSpeed would, or set '
        f'"gradient_clipping" to the value you choose'
    )


def _release(version: Any) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string such as ``"0.19.8"`` or ``"0.19.3+abc"``."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return tuple(int(p) for p in match.groups()) if match else None  # type: ignore[return-value]
