"""The allocator interface: where the flat buffers of a partitioner live.

A partitioner never calls ``torch.empty`` for model states itself; it asks the allocator, naming the
purpose of the buffer. The default allocator (``"flat"``) puts everything on the engine's device;
an offload allocator puts ``"master"`` and ``"optim_state"`` buffers in (pinned) host memory or
behind an NVMe swapper. Counting bytes per purpose here gives the memory breakdown per rank.
"""
from __future__ import annotations

import abc
from collections import defaultdict
from typing import Sequence

import torch

from zkit.core.copies import Copies, SynchronousCopies
from zkit.core.stores import MasterStore, OptimizerStepper, ParamShardStore

PURPOSES = ("param", "grad", "master", "master_grad", "optim_state", "bucket", "activation")


class Allocator(abc.ABC):
    """Hands out flat, 1-D, contiguous buffers and counts live bytes per purpose.

    Three methods let an allocator take over more than placement; each answers ``None`` by
    default (see :mod:`zkit.core.stores` for the protocols):

    * :meth:`master_store`: at stages 2-3, a store that keeps the fp32 master and its gradients
      elsewhere (files on NVMe);
    * :meth:`param_shard_store`: at stage 3, a store that keeps parameter shards elsewhere and
      reads them ahead of use;
    * :meth:`optimizer_stepper`: a function that runs the optimizer step itself, e.g. sub-group by
      sub-group around swaps of the optimizer state (zkit-offload's ``nvme``).

    Copies between its buffers go through :attr:`copies` (:mod:`zkit.core.copies`): plain
    ``copy_`` on the caller's thread unless the allocator sets its own (the built-in allocators
    use a side stream on an accelerator, :mod:`zkit.zero.copy_queue`); host buffers are pinned
    (:meth:`pin`) so such copies are asynchronous.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._live: dict[str, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)
        #: copies between the buffers this allocator hands out (:mod:`zkit.core.copies`)
        self.copies: Copies = SynchronousCopies()

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

    def master_store(self, shard_sizes: Sequence[int]) -> MasterStore | None:
        """At ZeRO stages 2-3, where the fp32 master of each unit's shard (``shard_sizes``: elements
        per unit) and its gradients live when not in this allocator's buffers. Default: ``None``."""
        return None

    def param_shard_store(self, dtype: torch.dtype) -> ParamShardStore | None:
        """At stage 3, where parameter shards of ``dtype`` live when not in this allocator's
        buffers. Default: ``None`` (shards in buffers of purpose ``"param"``)."""
        return None

    def optimizer_stepper(self) -> OptimizerStepper | None:
        """A function to call in place of ``optimizer.step()`` (the gradients are set and scaled).
        Default: ``None``, the partitioner steps (or fuses the step with the unscaling)."""
        return None

    def grads_beside_master(self) -> bool:
        """Whether ZeRO stages 2-3 keep this rank's reduced gradient shards beside the master, in
        fp32 ``"master_grad"`` buffers, instead of ``"grad"`` buffers on the device: each unit's
        reduced chunk is copied out of its bucket as it completes, so no device memory holds the
        gradients (ZeRO-Offload). Default: when the two purposes are placed apart."""
        return self.place("master_grad") != self.place("grad")

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
