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
    raise AttributeError(f"module 'zkit' has no attribute {name!r}")
