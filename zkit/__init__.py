"""zkit: train models far larger and faster than plain PyTorch allows - a small kernel plus plugins.

Public API::

    engine, optimizer, dataloader, lr_scheduler = zkit.initialize(model=..., config=...)
    zkit.Stack(partitioner="zero2", optimizer="adamw")      # compose plugins in Python
    @zkit.hookimpl                                          # write a plugin
"""
from __future__ import annotations

from zkit.hookspecs import hookimpl, hookspec
from zkit.records import (
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
        from zkit.engine import initialize

        return initialize
    if name == "Stack":
        from zkit.stack import Stack

        return Stack
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"zkit.{name}")
    if name in _DEEPSPEED_NAMES:
        # ``import zkit as deepspeed``: DeepSpeed's top-level names, from the compatibility layer
        import zkit.compat.deepspeed as compat

        return getattr(compat, name)
    raise AttributeError(f"module 'zkit' has no attribute {name!r}")


#: submodules reached as attributes (``deepspeed.comm.get_rank()`` after ``import zkit as deepspeed``)
_SUBMODULES = ("accelerator", "checkpointing", "comm", "zero")
_DEEPSPEED_NAMES = ("DeepSpeedConfig", "DeepSpeedEngine", "add_config_arguments", "get_accelerator",
                    "init_distributed", "init_inference", "log_dist", "logger", "ops", "runtime", "utils")
