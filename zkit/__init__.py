"""zkit: train models far larger and faster than plain PyTorch allows - a small kernel plus plugins.

Public API::

    engine, optimizer, dataloader, lr_scheduler = zkit.initialize(model=..., config=...)
    zkit.Stack(partitioner="zero2", optimizer="adamw")      # compose plugins in Python
    @zkit.hookimpl                                          # write a plugin

``import zkit as deepspeed`` gives zkit's own API under names DeepSpeed shares:
``deepspeed.initialize(model=..., config=...)`` (keywords; the config takes DeepSpeed's keys),
``deepspeed.zero.Init`` / ``deepspeed.zero.GatheredParameters`` (:mod:`zkit.zero`) and
``deepspeed.checkpointing`` (activation checkpointing, :mod:`zkit.activations.recompute`).
DeepSpeed's other names (``comm``, ``accelerator``, ``ops``, ``pipe``, ``utils``, ``runtime``,
``DeepSpeedEngine``, ``init_distributed``, ...) are not zkit's: reaching one raises an
``AttributeError`` that says to install the drop-in (the ``deepspeed`` distribution in
``plugins/zkit-deepspeed``) and ``import deepspeed``. The kernel never imports the drop-in.
"""
from __future__ import annotations

from zkit.core.hookspecs import hookimpl, hookspec
from zkit.core.records import (
    AllocatorRecord,
    AttentionRecord,
    CommunicatorRecord,
    ConfigSectionRecord,
    OptimizerRecord,
    PartitionerRecord,
    SchedulerRecord,
)

__version__ = "0.1.0"

__all__ = [
    "AllocatorRecord",
    "AttentionRecord",
    "CommunicatorRecord",
    "ConfigSectionRecord",
    "OptimizerRecord",
    "PartitionerRecord",
    "SchedulerRecord",
    "Stack",
    "hookimpl",
    "hookspec",
    "initialize",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: importing zkit to write a plugin must not build the engine machinery.
    if name == "initialize":
        from zkit.core.engine import initialize

        return initialize
    if name == "Stack":
        from zkit.core.stack import Stack

        return Stack
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(_SUBMODULES[name])
    if name in DEEPSPEED_ONLY_NAMES:
        raise AttributeError(
            f"module 'zkit' has no attribute {name!r}: deepspeed.{name} is DeepSpeed's name, not zkit's. "
            "For DeepSpeed's API on zkit, install zkit's drop-in, the 'deepspeed' distribution "
            "(pip install -e plugins/zkit-deepspeed), and `import deepspeed` instead of `import zkit as deepspeed`"
        )
    raise AttributeError(f"module 'zkit' has no attribute {name!r}")


#: submodules reached as attributes (``deepspeed.zero.Init`` after ``import zkit as deepspeed``)
_SUBMODULES = {"checkpointing": "zkit.activations.recompute", "zero": "zkit.zero"}
#: DeepSpeed's top-level names that only the drop-in provides: ``import zkit as deepspeed`` says so
DEEPSPEED_ONLY_NAMES = frozenset({
    "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "OnDevice", "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "accelerator", "add_config_arguments", "comm", "get_accelerator", "init_distributed", "init_inference",
    "launcher", "log_dist", "logger", "moe", "ops", "pipe", "runtime", "utils",
})
