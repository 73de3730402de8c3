"""``activation_checkpointing``, zkit.activations' section: its plugin registers it
(:mod:`zkit.activations.plugin`); :func:`activation_checkpointing_config` reads it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from zkit.core.config.fields import at_least, setting

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.config import ZkitConfig

SECTION = "activation_checkpointing"


@attrs.frozen(kw_only=True)
class ActivationCheckpointingConfig:
    """Settings of ``zkit.activations.recompute.checkpoint`` (activation recomputation)."""

    partition_activations: bool = setting(
        False, doc="Split checkpointed activations across model-parallel ranks."
    )
    cpu_checkpointing: bool = setting(
        False, doc="Keep checkpointed activations in host memory."
    )
    contiguous_memory_optimization: bool = setting(
        False, doc="Copy checkpointed activations into one preallocated buffer."
    )
    number_checkpoints: int | None = setting(
        None, check=at_least(1), doc="Checkpoints per forward (sizes that buffer)."
    )
    synchronize_checkpoint_boundary: bool = setting(
        False, doc="Synchronize the device at each checkpoint boundary."
    )
    profile: bool = setting(False, doc="Time the forward and recompute of checkpoints.")


def activation_checkpointing_config(config: "ZkitConfig") -> ActivationCheckpointingConfig:
    """``config``'s ``activation_checkpointing`` section (its defaults where it holds none)."""
    return config.section(SECTION) or ActivationCheckpointingConfig()
