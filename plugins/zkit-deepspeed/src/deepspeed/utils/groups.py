"""``deepspeed.utils.groups``: DeepSpeed's process-group queries, answered for zkit's engine, which
trains data-parallel over the whole world (``mpu=`` is refused; tensor and pipeline parallelism
are zkit-pipeline's ``ProcessGrid``, not these groups). So: the data-parallel group is the world,
model/tensor parallel sizes are 1 (ranks 0). The sequence-parallel group is the one of the last
engine ``deepspeed.initialize`` built with ``sequence_parallel_size`` above 1 (zkit-sequence's
layout, DeepSpeed's: consecutive ranks), whose ZeRO shards over the whole world (DeepSpeed's
sequence-data-parallel group); without one the size is 1 and the group DeepSpeed's ``KeyError``.
An engine built with ``mpu=`` DeepSpeed's sequence-parallel groups (``parallel_state_sp``) answers
as DeepSpeed's does then: the data-parallel group and its size are ``None`` (DeepSpeed asks such an
mpu for none), the sequence-data-parallel ones the mpu's. Expert (MoE) groups are refused;
``_get_expert_parallel_ranks`` is pure arithmetic and computes DeepSpeed's layout.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from deepspeed.refused import FeatureNotProvided

_NO_EXPERTS = ("zkit has no mixture-of-experts (expert-parallel) training, so it builds no expert groups: "
               "train without MoE layers, or with DeepSpeed")


def _initialized() -> None:
    if not dist.is_initialized():
        raise RuntimeError("dist is not initialized: call deepspeed.init_distributed() (or deepspeed.initialize) first")


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's set-up of expert and model-parallel groups: nothing to do for ``ep_size=1``
    without ``mpu``; anything else is refused."""
    if ep_size != 1:
        raise FeatureNotProvided(f"groups.initialize(ep_size={ep_size}): {_NO_EXPERTS}")
    if mpu is not None:
        raise FeatureNotProvided("groups.initialize(mpu=...): zkit takes no model-parallel unit; tensor and pipeline "
                                 "parallelism come from zkit-pipeline's ProcessGrid")


# -- data parallel: the world ------------------------------------------------------------------
def get_data_parallel_group() -> Any:
    _initialized()
    return dist.group.WORLD


def get_data_parallel_world_size() -> int:
    _initialized()
    return dist.get_world_size()


def get_data_parallel_rank() -> int:
    _initialized()
    return dist.get_rank()


def _get_data_parallel_group() -> Any:
    """The world; ``None`` under DeepSpeed's sequence-parallel mpu, as DeepSpeed's."""
    return None if _sequence_mpu is not None else get_data_parallel_group()


def _get_data_parallel_world_size() -> int | None:
    """The world's size; ``None`` under DeepSpeed's sequence-parallel mpu, as DeepSpeed's."""
    return None if _sequence_mpu is not None else get_data_parallel_world_size()


def _get_data_parallel_rank() -> int:
    return get_data_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    return get_data_parallel_group() if _sequence_mpu is None else _sequence_mpu.get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(_get_sequence_data_parallel_group())


def _get_data_parallel_group_ranks() -> range:
    _initialized()
    return range(dist.get_world_size())


def _get_broadcast_src_rank() -> int:
    _initialized()
    return 0


# -- model / tensor / sequence parallel: none ------------------------------------------------------
def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_world_size = _get_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    _initialized()
    return dist.get_rank()


#: the sequence-parallel group of the last engine built with ``sequence_parallel_size`` above 1
#: (``deepspeed.initialize`` records it; DeepSpeed keeps its groups module-wide too), else None
_sequence_parallel_group: Any = None
#: DeepSpeed's sequence-parallel mpu that engine was built with (``parallel_state_sp``), else None
_sequence_mpu: Any = None


def _set_sequence_parallel_group(group: Any, mpu: Any = None) -> None:
    """Record the sequence-parallel group of the engine ``deepspeed.initialize`` built (None: none)
    and the sequence-parallel ``mpu`` it was given (None: none)."""
    global _sequence_parallel_group, _sequence_mpu
    _sequence_parallel_group, _sequence_mpu = group, mpu


def _get_sequence_parallel_world_size() -> int:
    return 1 if _sequence_parallel_group is None else dist.get_world_size(_sequence_parallel_group)


def _get_sequence_parallel_rank() -> int:
    return 0 if _sequence_parallel_group is None else dist.get_rank(_sequence_parallel_group)


def _get_sequence_parallel_group() -> Any:
    if _sequence_parallel_group is None:
        raise KeyError("No sequence parallel group found: no engine was built with sequence_parallel_size above 1 "
                       "(zkit-sequence); the sequence-parallel size is 1")
    return _sequence_parallel_group


# -- experts: refused, but for the pure layout computation --------------------------------------------
def _create_expert_and_data_parallel(expert_parallel_size_: int, *args: Any, **kwargs: Any) -> None:
    raise FeatureNotProvided(f"groups._create_expert_and_data_parallel: {_NO_EXPERTS}")


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, *args: Any, **kwargs: Any) -> None:
    raise FeatureNotProvided(f"groups._create_expert_data_and_model_parallel: {_NO_EXPERTS}")


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's expert-parallel and expert-data-parallel rank lists for a world of
    ``world_size`` split tensor x pipeline x data (experts split the data-parallel ranks)."""
    model = tensor_parallel_size_ * pipeline_parallel_size_
    if world_size % model:
        raise ValueError(f"{world_size} is not divisible by {model}")
    dp_world = world_size // model
    if dp_world % expert_parallel_size_:
        raise ValueError(f"{dp_world} is not divisible by {expert_parallel_size_}")
    tp, stage_span = tensor_parallel_size_, world_size // pipeline_parallel_size_
    dp_groups: list[list[int]] = []
    for start in range(0, world_size, stage_span):
        stop = start + stage_span
        for i in range(tp):
            if use_data_before_expert_parallel_:
                stride = dp_world // expert_parallel_size_
                dp_groups.append([r for d in range(stride) for r in range(start + i + d * tp, stop, stride * tp)])
            else:
                dp_groups.append(list(range(start + i, stop, tp)))
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for ranks in dp_groups:
        parts = [ranks[i:i + expert_parallel_size_] for i in range(0, dp_world, expert_parallel_size_)]
        expert_groups += parts
        expert_data_groups += [list(column) for column in zip(*parts)]
    return expert_groups, expert_data_groups


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _get_max_expert_size() -> None:
    return None
