"""The activation checkpointing settings of this process, from a config, an engine or keywords."""
from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from zkit.core.allocator import Allocator
from zkit.core.assembly import Assembly
from zkit.core.communicator import Communicator
from zkit.activations.config import ActivationCheckpointingConfig, activation_checkpointing_config
from zkit.core.config import ZkitConfig
from zkit.core.config.structure import Context, structure


@attrs.frozen(kw_only=True)
class CheckpointSettings:
    """What :func:`zkit.activations.recompute.checkpoint` does besides recomputation.

    The first six fields are the ``activation_checkpointing`` config keys (DeepSpeed's names).
    ``group`` is the tensor-parallel communicator that ``partition_activations`` splits saved
    inputs over (``None``, or a group of one rank: nothing to split). ``allocator`` is the
    engine's, when one is active: host copies are counted (and, where it places activations on
    the host, allocated) under its ``"activation"`` purpose. ``assembly`` is the engine's, when
    configured from one: a torch process group passed as a group becomes its communicator.
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    group: Communicator | None = None
    allocator: Allocator | None = None
    assembly: Assembly | None = None
    pin_memory: bool = True

    @property
    def splits(self) -> bool:
        """Whether saved inputs are really split (partitioning on, over more than one rank)."""
        return self.partition_activations and self.group is not None and self.group.world_size > 1

    @property
    def transforms_inputs(self) -> bool:
        """Whether saved inputs are stored other than by reference."""
        return self.splits or self.cpu_checkpointing

    @classmethod
    def from_section(cls, section: ActivationCheckpointingConfig, **extra: Any) -> CheckpointSettings:
        return cls(
            partition_activations=section.partition_activations,
            cpu_checkpointing=section.cpu_checkpointing,
            contiguous_memory_optimization=section.contiguous_memory_optimization,
            number_checkpoints=section.number_checkpoints,
            synchronize_checkpoint_boundary=section.synchronize_checkpoint_boundary,
            profile=section.profile,
            **extra,
        )


def section_from(source: Any) -> tuple[ActivationCheckpointingConfig, Allocator | None]:
    """The ``activation_checkpointing`` section (and the engine's allocator, if any) of an
    engine, a :class:`~zkit.core.config.ZkitConfig`, a section, a full config dict (one holding the
    key ``activation_checkpointing``) or a dict of the section's own keys."""
    if source is None:
        return ActivationCheckpointingConfig(), None
    if isinstance(source, ActivationCheckpointingConfig):
        return source, None
    if isinstance(source, ZkitConfig):
        return activation_checkpointing_config(source), None
    config = getattr(source, "config", None)
    if isinstance(config, ZkitConfig):  # an engine
        return activation_checkpointing_config(config), getattr(source, "allocator", None)
    if isinstance(source, Mapping):
        if "activation_checkpointing" in source:
            data, path = source["activation_checkpointing"], "activation_checkpointing"
        else:
            data, path = dict(source), "activation_checkpointing"
        return structure(ActivationCheckpointingConfig, data, path, Context(sections={})), None
    raise TypeError(
        "zkit.activations.recompute.configure takes an engine, a ZkitConfig, a config dict or an "
        f"ActivationCheckpointingConfig, got {type(source).__name__}"
    )


def assembly_of(source: Any) -> Assembly | None:
    """The engine's assembly when ``source`` is an engine, else None."""
    assembly = getattr(source, "assembly", None)
    return assembly if isinstance(assembly, Assembly) else None


def as_communicator(group: Any, assembly: Assembly | None = None) -> Communicator | None:
    """A zkit communicator from a communicator, a torch ProcessGroup, or ``None``. A process
    group gets the communicator ``assembly`` (the engine's; else one built for the defaults and
    the installed plugins) gives for it."""
    if group is None or isinstance(group, Communicator):
        return group
    if isinstance(group, torch.distributed.ProcessGroup):
        return (assembly or Assembly.build()).communicator(group)
    raise TypeError(
        "group= must be a zkit Communicator (e.g. ProcessGrid.build()['tensor']) or a "
        f"torch.distributed ProcessGroup, got {type(group).__name__}"
    )
