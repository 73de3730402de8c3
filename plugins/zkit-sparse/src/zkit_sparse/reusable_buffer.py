"""A buffer for the saved probabilities, reused from one training step to the next.

The probabilities the block-sparse backward needs are tens to hundreds of MiB. Allocated fresh
every step, each of their pages is faulted in and zeroed by the kernel again (the C allocator
returns large blocks to the system when they are freed), which costs about a tenth of the whole
forward+backward on CPU. :class:`ReusableBuffer` keeps one flat buffer per module and hands it
out again once nothing else references its storage: the saved tensors of the previous step are
released when its backward ran, so the buffer is normally free at the next forward. While it is
still referenced (``retain_graph=True``, two forwards before one backward, a saved-tensor hook
holding it) a fresh buffer is allocated instead, so reuse can never overwrite live data.
"""
from __future__ import annotations

import threading

import torch


def _storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage (views, saved tensors, aliases made by hooks)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_CAN_COUNT = hasattr(torch._C, "_storage_Use_Count")


class ReusableBuffer:
    """Hands out flat tensors, reusing the previous one when its storage is no longer shared."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._idle_refs = 0  # reference count of the storage when only this object holds it
        self._lock = threading.Lock()  # check-and-hand-out must not interleave between threads

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined)."""
        with self._lock:
            buf = self._buf
            if (buf is None or not _CAN_COUNT or buf.dtype != dtype or buf.device != device
                    or buf.numel() < numel or _storage_refs(buf) != self._idle_refs):
                buf = torch.empty(numel, dtype=dtype, device=device)
                self._buf = buf
                self._idle_refs = _storage_refs(buf) if _CAN_COUNT else 0
            return buf[:numel]

    def release(self) -> None:
        """Forget the buffer (its memory is freed once nothing else uses it)."""
        self._buf = None


class Workspace:
    """Named scratch tensors carved from one flat buffer, for the temporaries of a chunk loop.

    Each name gets a fixed slot of its largest size, so a loop over chunks of varying shapes
    writes into the same memory every iteration (ops take ``out=``) instead of allocating and
    page-faulting fresh tensors chunk after chunk.
    """

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device,
                 buffer: ReusableBuffer | None = None):
        total = sum(sizes.values())
        flat = (torch.empty(total, dtype=dtype, device=device) if buffer is None
                else buffer.take(total, dtype, device))
        self._slots: dict[str, torch.Tensor] = {}
        offset = 0
        for name, size in sizes.items():
            self._slots[name] = flat[offset:offset + size]
            offset += size

    def get(self, name: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The slot ``name`` viewed as a contiguous tensor of ``shape`` (contents undefined)."""
        n = 1
        for s in shape:
            n *= s
        return self._slots[name][:n].view(shape)
