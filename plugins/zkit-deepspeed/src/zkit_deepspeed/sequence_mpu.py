"""``deepspeed.initialize(mpu=parallel_state_sp)``: an engine over DeepSpeed's sequence-parallel groups.

Accelerate (``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``) and the Transformers
``Trainer`` hand ``deepspeed.initialize`` the module ``UlyssesSPAttentionHF.register_with_transformers`` returned.
DeepSpeed reads it as: sequence groups of ``P`` ranks, batch sizes counting each group as one
replica, ZeRO sharding over every rank. The drop-in builds zkit's engine with
``sequence_parallel_size = P`` over the module's own group (:func:`sequence_group` answers the
engine's ``zkit_sequence_parallel`` hook with it while :func:`building_with` is active).

DeepSpeed 0.19.8's gradients then depend on the ZeRO stage. At stages 0-2 it sums them over every
rank and divides by the ``world / P`` data-parallel replicas only; at stage 3 it averages over
every rank, as zkit does. With the loss Transformers' ``deepspeed_sp_compute_loss`` computes (the
whole sequence's, on every rank, through a differentiable all-gather, so that each rank's slice
receives ``P`` times its share) stages 0-2 give ``P`` times the gradient of the loss, stage 3 the
gradient itself: measured on the CPU with ``plugins/zkit-deepspeed/tests/hf_sequence_flow.py``, the
gradient norm at ``P = 2`` is 2.503 at stages 1 and 2 and 1.2515 at stage 3 and without sequence
parallelism, with equal losses under AdamW (whose steps, and clipping's, do not see the scale). The
drop-in gives the gradients DeepSpeed's scale, stage for stage (:class:`ReplicaAveragedMicroStep`
at stages 0-2), so gradient norms, clipping thresholds and optimizers that see the scale (SGD)
agree with DeepSpeed's. zkit's own ``sequence_parallel_size`` with zkit-sequence's loss gives the
gradient of the loss at every stage.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from zkit.core.microstep import MicroStep

#: the mpu of the engine being built by deepspeed.initialize (None: none, or not a sequence one)
_BUILDING: contextvars.ContextVar[Any] = contextvars.ContextVar("deepspeed_sequence_mpu", default=None)
_KEY = "sequence_parallel_size"


def sequence_mpu(mpu: Any) -> Any:
    """``mpu`` when it is DeepSpeed's sequence-parallel state (what DeepSpeed tests:
    ``initialize_sequence_parallel``), else None."""
    return mpu if mpu is not None and hasattr(mpu, "initialize_sequence_parallel") else None


def with_sequence_parallel_size(config: Any, size: int) -> Any:
    """``config`` (a dict, a JSON file's path, or None) with ``sequence_parallel_size`` set to
    ``size``; a config that names another size is refused, naming both."""
    data = config
    if isinstance(config, (str, os.PathLike)):
        data = json.loads(Path(config).read_text(encoding="utf-8"))
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"deepspeed.initialize(mpu=...): the config must be a dict or a JSON file's path, got "
                         f"{type(config).__name__}")
    given = data.get(_KEY)
    if given is not None and given != size:
        raise ValueError(f"deepspeed.initialize: config key '{_KEY}' is {given}, but mpu= holds sequence-parallel "
                         f"groups of {size} ranks; leave the key out or make them agree")
    return {**data, _KEY: size}


@contextlib.contextmanager
def building_with(mpu: Any) -> Iterator[None]:
    """While the engine is built, its ``zkit_sequence_parallel`` hook answers with ``mpu``'s group."""
    token = _BUILDING.set(mpu)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_mpu() -> Any:
    """The sequence-parallel mpu of the engine being built now (None outside ``building_with``)."""
    return _BUILDING.get()


def sequence_group(module: torch.nn.Module, size: int) -> Any:
    """The ``zkit_sequence_parallel`` answer while ``building_with(mpu)``: ``mpu``'s group, whose
    ``size`` ranks run the model's ``UlyssesSPAttentionHF``; None otherwise (zkit-sequence answers)."""
    mpu = _BUILDING.get()
    if mpu is None:
        return None
    if getattr(module, "data_parallel_group", None) is not None:
        raise ValueError(f"mpu= with sequence-parallel groups of {size} ranks and a model that brings its own "
                         f"data-parallel group ({type(module).__name__}: zkit-pipeline's pipeline or tensor "
                         f"parallelism) is not supported: use one or the other")
    group = mpu.get_sequence_parallel_group()
    if torch.distributed.get_world_size(group) != size:
        raise ValueError(f"mpu='s sequence-parallel group has {torch.distributed.get_world_size(group)} ranks, the "
                         f"config's sequence_parallel_size is {size}")
    return group


class ReplicaAveragedMicroStep(MicroStep):
    """DeepSpeed's gradient under ``mpu=``: the partitioner averages over every rank, so the loss
    back-propagated is ``sequence_parallel_size`` times larger, which makes the average a sum over
    every rank divided by the data-parallel replicas (bit for bit when the factor is a power of two)."""

    def __init__(self, engine: Any, factor: int) -> None:
        super().__init__(engine)
        self.factor = factor

    def scale(self, loss: torch.Tensor, divide_by_accumulation: bool = True) -> torch.Tensor:
        return super().scale(loss, divide_by_accumulation=divide_by_accumulation) * self.factor
