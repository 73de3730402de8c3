"""The built-in plugin that applies the host-memory policy (:mod:`zkit.host_memory.malloc_policy`)
around building: before anything is built (an engine, or ``zkit.zero.Init``'s modules) and once
an engine is built."""
from __future__ import annotations

import os
from typing import Any

import zkit
from zkit.host_memory import malloc_policy


@zkit.hookimpl
def zkit_configure(config: Any, device: Any) -> None:
    # before building: under ZKIT_HOST_MALLOC=return, what building frees goes back from the start
    malloc_policy.return_freed_memory()


@zkit.hookimpl(trylast=True)
def zkit_engine_setup(engine: Any) -> None:
    # last: after every other plugin's set-up, the engine is as built as it gets before training
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", engine.world_size))
    malloc_policy.fit_to_memory(host_state_bytes(engine), local_ranks)
    malloc_policy.trim()  # what building and partitioning the model freed


@zkit.hookimpl
def zkit_model_built_partitioned(assembly: Any) -> None:
    malloc_policy.trim()  # each module's full tensors, freed as zkit.zero.Init partitioned it


def host_state_bytes(engine: Any) -> int:
    """The rank's model states in host memory: all of them on a CPU device, none on an
    accelerator (the offload allocators manage their own host memory)."""
    return engine.partitioner.host_state_bytes() if engine.device.type == "cpu" else 0
