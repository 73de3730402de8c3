"""What the plugin keeps per engine: the recorded gradient norms, in the engine's stash."""
from __future__ import annotations

from typing import Any

import attrs

from zkit.core.stash import StashKey
from zkit_example_plugin.section import GradNormWatchConfig


@attrs.define
class NormHistory:
    """``(optimizer step, global gradient norm)`` pairs, the norm unscaled (fp16's loss scale
    divided out)."""

    config: GradNormWatchConfig
    norms: list[tuple[int, float]] = attrs.field(factory=list)


#: the engine's history; set at engine setup when the config has a ``grad_norm_watch`` section
HISTORY: StashKey[NormHistory] = StashKey()


def grad_norms(engine: Any) -> list[tuple[int, float]]:
    """The norms recorded so far for ``engine`` (empty without a ``grad_norm_watch`` section)."""
    history = engine.stash.get(HISTORY, None)
    return [] if history is None else list(history.norms)
