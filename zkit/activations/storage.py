"""Where a checkpointed region's saved inputs are kept until its recomputation.

A non-reentrant checkpoint keeps only the region's inputs; everything inside is recomputed in
backward. Those inputs are saved through autograd's saved-tensor mechanism, so a pair of
``saved_tensors_hooks`` around the checkpoint call sees exactly them and can store them elsewhere:

* ``partition_activations``: each tensor-parallel rank keeps one ``1/T`` slice of every input
  (inputs are replicated over the tensor group, as the residual stream is); backward all-gathers
  the slices back before recomputing.
* ``cpu_checkpointing``: the (sliced) input lives in host memory, pinned when CUDA is present, and
  is copied back to the device for recomputation.
* ``contiguous_memory_optimization``: the stored copies are carved out of one flat arena per
  device instead of separate allocations, so many small long-lived buffers do not fragment the
  device allocator between the forward and the backward pass.

Leaf tensors that require gradients (parameters passed as inputs) are kept by reference: copying
them saves nothing, their storage is alive anyway.
"""
from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

from zkit.activations.settings import CheckpointSettings

_ALIGN = 64  # bytes: every arena slice starts cache-line (and vector-load) aligned


class ActivationArena:
    """One flat byte buffer on one device that stored inputs are carved from, bump-allocated.

    The offset returns to zero when every slice handed out has been freed (the backward pass has
    consumed the checkpoints). A request that does not fit is served by a separate allocation
    and remembered, so the arena is grown to the high-water mark at its next reset: from the
    second step on, one buffer serves every checkpoint. ``first_size`` (``number_checkpoints``
    times the first request) sizes the buffer before anything has been measured.
    """

    def __init__(self, device: torch.device, new_buffer, number_checkpoints: int | None = None) -> None:
        self.device = device
        self._new_buffer = new_buffer  # (nbytes, device) -> uint8 tensor
        self.number_checkpoints = number_checkpoints
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.live = 0
        self.high_water = 0
        self.overflows = 0  # requests served outside the arena since it was created

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        start = -(-self.offset // _ALIGN) * _ALIGN
        end = start + nbytes
        self.high_water = max(self.high_water, end)
        if self.buffer is None and self.live == 0:
            size = max(self.high_water, nbytes * (self.number_checkpoints or 0))
            self.buffer = self._new_buffer(size, self.device)
        if self.buffer is not None and end <= self.buffer.numel():
            base = self.buffer
            out = base[start:end].view(dtype)
            self.offset = end
        else:
            self.overflows += 1
            self.offset = end  # keep counting the bytes this pass needs
            base = self._new_buffer(nbytes, self.device)
            out = base.view(dtype)
        out._zkit_base = base  # the buffer object (and its accounting) lives as long as a slice
        self.live += 1
        weakref.finalize(out, self._freed)
        return out

    def _freed(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.offset = 0
            if self.buffer is not None and self.buffer.numel() < self.high_water:
                self.buffer = None  # regrown at the next take, to the measured high-water mark


@attrs.frozen
class _Stored:
    """A saved input in storage: its (local) data and how to rebuild the full tensor."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    numel: int
    split: bool


class InputStore:
    """Pack/unpack functions for ``torch.autograd.graph.saved_tensors_hooks`` that store
    checkpoint inputs as :class:`CheckpointSettings` asks. One per configuration (the arenas live
    here)."""

    def __init__(self, settings: CheckpointSettings) -> None:
        self.settings = settings
        self._arenas: dict[torch.device, ActivationArena] = {}

    # -- buffers -------------------------------------------------------------------------------
    def _raw(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A fresh uint8 buffer; host buffers through the engine's allocator where it has one."""
        alloc = self.settings.allocator
        if device.type == "cpu":
            if alloc is not None and alloc.place("activation").type == "cpu":
                buf = alloc.empty(nbytes, torch.uint8, "activation")
                weakref.finalize(buf, alloc.track, "activation", -nbytes)
                return buf
            pin = self.settings.pin_memory and torch.cuda.is_available()
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if alloc is not None:
            alloc.track("activation", nbytes)
            weakref.finalize(buf, alloc.track, "activation", -nbytes)
        return buf

    def _empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.settings.contiguous_memory_optimization:
            arena = self._arenas.get(device)
            if arena is None:
                arena = self._arenas[device] = ActivationArena(device, self._raw, self.settings.number_checkpoints)
            return arena.take(numel, dtype)
        nbytes = numel * dtype.itemsize
        base = self._raw(nbytes, device)
        out = base.view(dtype)
        out._zkit_base = base  # its finalizer returns the bytes to the allocator's count
        return out

    def arena(self, device: torch.device | str) -> ActivationArena | None:
        """The arena of ``device`` (``None`` before it is first used or without the option)."""
        return self._arenas.get(torch.device(device))

    # -- hooks ---------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if t.requires_grad and t.is_leaf:
            return t
        s = self.settings
        flat = t.detach().reshape(-1)
        numel = flat.numel()
        split = s.splits
        if split:
            world, rank = s.group.world_size, s.group.rank
            shard = -(-numel // world)
            lo, hi = min(rank * shard, numel), min((rank + 1) * shard, numel)
            local, local_numel = flat[lo:hi], shard
        else:
            local, local_numel = flat, numel
        target = torch.device("cpu") if s.cpu_checkpointing else t.device
        data = self._empty(local_numel, t.dtype, target)
        data[: local.numel()].copy_(local, non_blocking=data.is_pinned())
        if local.numel() < local_numel:
            data[local.numel():].zero_()  # the last rank's slice is padded to the common size
        return _Stored(data, t.shape, t.device, numel, split)

    def unpack(self, stored: Any) -> torch.Tensor:
        if isinstance(stored, torch.Tensor):
            return stored
        local = stored.data.to(stored.device, non_blocking=True)
        if not stored.split:
            return local.view(stored.shape)
        group = self.settings.group
        full = torch.empty(local.numel() * group.world_size, dtype=local.dtype, device=stored.device)
        group.all_gather(full, local)
        return full[: stored.numel].view(stored.shape)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
