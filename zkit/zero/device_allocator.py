"""The default allocator: every flat buffer on the engine's device."""
from __future__ import annotations

import torch

import zkit
from zkit.core.allocator import Allocator
from zkit.core.records import AllocatorRecord
from zkit.zero.copy_queue import CopyQueue


class DeviceAllocator(Allocator):
    """All purposes live on the training device; copies run on a side stream on an accelerator
    (:class:`~zkit.zero.copy_queue.CopyQueue`)."""

    def __init__(self, device: torch.device, config=None) -> None:
        super().__init__(device)
        self.copies = CopyQueue(self.device)

    def place(self, purpose: str) -> torch.device:
        return self.device


@zkit.hookimpl(trylast=True)
def zkit_register_allocators():
    yield AllocatorRecord(
        name="flat", factory=DeviceAllocator, description="flat buffers on the training device"
    )
