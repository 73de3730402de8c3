"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's sequence-parallel groups
(the ``mpu`` that ``UlyssesSPAttentionHF.register_with_transformers`` returns and Accelerate hands
to ``deepspeed.initialize(mpu=...)``).

``initialize_sequence_parallel(sequence_parallel_size)`` splits the world into groups of
consecutive ranks (zkit-sequence's layout, DeepSpeed's) and one sequence-data-parallel group of
every rank (ZeRO shards over all of them); the getters answer for this rank, and the model-parallel
getters are aliases of the sequence-parallel ones, as in DeepSpeed. Errors are DeepSpeed's.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zkit_deepspeed.optional import import_plugin

_SEQUENCE_PARALLEL_GROUP: Any = None
_SEQUENCE_DATA_PARALLEL_GROUP: Any = None


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (DeepSpeed calls it when the world is torn down)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    _SEQUENCE_PARALLEL_GROUP = _SEQUENCE_DATA_PARALLEL_GROUP = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel groups (collective: every rank, once)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized: call "
                           "deepspeed.init_distributed() first")
    world = dist.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size})")
    if _SEQUENCE_PARALLEL_GROUP is not None or _SEQUENCE_DATA_PARALLEL_GROUP is not None:
        raise RuntimeError("sequence parallel group is already initialized")
    layout = import_plugin("zkit_sequence.groups", "deepspeed.runtime.sequence_parallel.parallel_state_sp").layout
    rank = dist.get_rank()
    for ranks in layout(world, sequence_parallel_size)[0]:
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))


def get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group."""
    if _SEQUENCE_PARALLEL_GROUP is None:
        raise RuntimeError("sequence parallel group is not initialized")
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group() -> Any:
    """The group ZeRO shards over: every rank."""
    if _SEQUENCE_DATA_PARALLEL_GROUP is None:
        raise RuntimeError("sequence data parallel group is not initialized")
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


# one dimension besides data parallelism: the model-parallel names answer for the sequence group
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
