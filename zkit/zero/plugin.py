"""The ZeRO stages as partitioner records, and the ``zero_optimization`` section whose ``stage`` chooses
one of them."""
from __future__ import annotations

import zkit
from zkit.core.records import ConfigSectionRecord, PartitionerRecord
from zkit.zero.config import SECTION, ZeroConfig, zero_config
from zkit.zero.stage0 import Stage0
from zkit.zero.stage1 import Stage1
from zkit.zero.stage2 import Stage2
from zkit.zero.init_adopt import adopt_init_model
from zkit.zero.stage3 import Stage3


#: why stage 3 cannot train a module torch.compile-d whole (zkit.core.compile): Dynamo guards a
#: compiled forward on the parameters as it found them, and stage 3 swaps placeholders for gathered
#: values inside it. engine.compile() compiles stage 3 block by block instead (Stage3.compile_regions).
STAGE3_COMPILE_REFUSAL = (
    "torch.compile of a whole model with ZeRO stage 3 is not supported: stage 3 turns each released parameter "
    "from a placeholder into its gathered values inside forward, and Dynamo would compile the forward again at "
    "every step. engine.compile() compiles stage 3 block by block, gathering each block outside its compiled "
    "forward: call it after initialize (not initialize(model=torch.compile(model))), with "
    "zero_optimization.stage3_gather_unit \"block\" (the default, but not with offload_param on nvme, whose "
    "units are per module) and a model whose layers are the children of a ModuleList or Sequential"
)

#: stage, class, extra names, what it partitions
STAGES = (
    (0, Stage0, ("ddp",), "data parallel: replicated states, bucketed all-reduce overlapping backward"),
    (1, Stage1, (), "ZeRO-1: optimizer states partitioned"),
    (2, Stage2, (), "ZeRO-2: optimizer states and gradients partitioned"),
    (3, Stage3, (), "ZeRO-3: optimizer states, gradients and parameters partitioned"),
)


@zkit.hookimpl(trylast=True)
def zkit_register_partitioners():
    for stage, factory, aliases, description in STAGES:
        yield PartitionerRecord(name=f"zero{stage}", stage=stage, factory=factory,
                                aliases=(f"stage{stage}", *aliases), description=description,
                                compile_refusal=STAGE3_COMPILE_REFUSAL if stage == 3 else None)


@zkit.hookimpl(trylast=True)
def zkit_prepare_model(model, stage, world_size):
    # built under zkit.zero.Init: units this partitioner would not keep as they are, whole again
    adopt_init_model(model, stage, world_size)


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    yield ConfigSectionRecord(path=SECTION, schema=ZeroConfig, description="ZeRO partitioning.",
                              default_when_absent=True)


@zkit.hookimpl(trylast=True)
def zkit_configure(config):
    # the config's choice; a user's zkit.Stack(partitioner=...) and installed plugins' choices win
    return zkit.Stack(partitioner=f"zero{zero_config(config).stage}")
