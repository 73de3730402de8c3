"""The allocator interface: where the flat buffers of a partitioner live.

A partitioner never calls ``torch.empty`` for model states itself; it asks the allocator, naming the
purpose of the buffer. The default allocator (``"flat"``) puts everything on the engine's device;
an offload allocator puts ``"master"`` and ``"optim_state"`` buffers in (pinned) host memory or
behind an NVMe swapper. Counting bytes per purpose here gives the memory breakdown per rank.
"""
from __future__ import annotations

import abc
from collections import defaultdict

import torch

PURPOSES = ("param", "grad", "master", "master_grad", "optim_state", "bucket", "activation")


class Allocator(abc.ABC):
    """Hands out flat, 1-D, contiguous buffers and counts live bytes per purpose.

    Two optional methods let an allocator take over more than placement (the ZeRO partitioner
    looks them up with ``getattr``):

    * ``step_optimizer(optimizer)``: run the optimizer step itself, e.g. sub-group by sub-group
      around swaps of the optimizer state (zkit-offload's ``nvme``).
    * ``param_shard_store(dtype)``: at stage 3, return a store that keeps parameter shards
      elsewhere (files on NVMe) and reads them ahead of use, or ``None``; see
      ``zkit/zero/stage3.py`` for the calls it must answer.
    * ``master_store(shard_sizes)``: at stages 2-3, return a store that keeps the fp32 master and
      its gradients elsewhere (files on NVMe), or ``None``. The partitioner then calls
      ``write_master(unit, values)``, ``read_master(unit)``, ``add_grad(unit, grad)`` (one
      micro-step's reduced shard, accumulated until ``zero_grad()``), ``grad_norm_sq()`` and
      ``step(optimizer, owned, grad_factor, publish)``, which steps the optimizer and calls
      ``publish(unit, master)`` for every updated unit; ``self.master`` holds placeholders.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._live: dict[str, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)

    @abc.abstractmethod
    def place(self, purpose: str) -> torch.device:
        """The device a buffer of ``purpose`` lives on."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        """Refuse, right after the partitioner builds it (so at initialize, not at the first step),
        an optimizer this allocator cannot step: raise ``ValueError`` naming ``name`` (the
        optimizer record's) and what it lacks. Default: every optimizer is fine."""

    def close(self) -> None:
        """Release what the allocator holds beyond its buffers (swap files, threads); the engine
        calls it once from ``engine.close()``. Default: nothing to release."""

    def pin(self, purpose: str) -> bool:
        """Whether host buffers of ``purpose`` should be page-locked (only meaningful with CUDA)."""
        return False

    def empty(self, numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
        """A new flat buffer of ``numel`` elements (uninitialised)."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown buffer purpose {purpose!r}; valid: {', '.join(PURPOSES)}")
        device = self.place(purpose)
        pin = self.pin(purpose) and device.type == "cpu" and torch.cuda.is_available()
        buf = torch.empty(int(numel), dtype=dtype, device=device, pin_memory=pin)
        self.track(purpose, buf.numel() * buf.element_size())
        return buf

    def zeros(self, numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
        return self.empty(numel, dtype, purpose).zero_()

    def release(self, buf: torch.Tensor, purpose: str) -> None:
        """Tell the allocator a buffer is no longer used (its bytes leave the live count)."""
        self.track(purpose, -buf.numel() * buf.element_size())

    def track(self, purpose: str, nbytes: int) -> None:
        self._live[purpose] += nbytes
        self._peak[purpose] = max(self._peak[purpose], self._live[purpose])

    def stats(self) -> dict[str, dict[str, int]]:
        """``{purpose: {"live": bytes, "peak": bytes}}``."""
        return {p: {"live": self._live[p], "peak": self._peak[p]} for p in sorted(self._live)}
