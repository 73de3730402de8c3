"""The ZeRO stages as partitioner records (``zero_optimization.stage`` selects by ``stage``)."""
from __future__ import annotations

import zkit
from zkit.core.records import PartitionerRecord
from zkit.zero.stage0 import Stage0
from zkit.zero.stage1 import Stage1
from zkit.zero.stage2 import Stage2
from zkit.zero.init_adopt import adopt_init_model
from zkit.zero.stage3 import Stage3


@zkit.hookimpl(trylast=True)
def zkit_register_partitioners():
    yield PartitionerRecord(
        name="zero0",
        stage=0,
        factory=Stage0,
        aliases=("stage0", "ddp"),
        description="data parallel: replicated states, bucketed all-reduce overlapping backward",
    )
    yield PartitionerRecord(
        name="zero1",
        stage=1,
        factory=Stage1,
        aliases=("stage1",),
        description="ZeRO-1: optimizer states partitioned",
    )
    yield PartitionerRecord(
        name="zero2",
        stage=2,
        factory=Stage2,
        aliases=("stage2",),
        description="ZeRO-2: optimizer states and gradients partitioned",
    )
    yield PartitionerRecord(
        name="zero3",
        stage=3,
        factory=Stage3,
        aliases=("stage3",),
        description="ZeRO-3: optimizer states, gradients and parameters partitioned",
    )


@zkit.hookimpl(trylast=True)
def zkit_prepare_model(model, stage, world_size):
    # built under zkit.zero.Init: units this partitioner would not keep as they are, whole again
    adopt_init_model(model, stage, world_size)
