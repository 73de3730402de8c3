"""Measurements of one stage while the interpreter runs: compute time per instruction kind against
the batch's wall time (the stage's bubble), and the bytes of activations autograd holds for backward
(the schedule's memory).

Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``: each saved storage
once (parameters excluded) from the moment it is saved until autograd drops it (after its backward,
or after the weight-gradient half of a split backward).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from typing import Any, Iterator

import torch


class _Packed:
    """What autograd keeps in place of a saved tensor while the probe counts it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class StageProbe:
    """Timers and a saved-activation counter for one stage; disabled it costs nothing.

    After one or more batches, :meth:`report` gives ``wall_s`` (batch wall time), ``busy_s`` (time
    in forward and backward), ``busy_by_kind`` (seconds per instruction kind), ``idle_fraction``
    (``1 - busy / wall``), ``peak_saved_bytes``, ``batches`` and ``spans`` (each batch's start and
    end on ``time.perf_counter``, which on Linux is one clock for all processes of a machine: the
    stages' spans give the pipeline's makespan, tail included)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self.wall = 0.0
        self.busy: dict[str, float] = defaultdict(float)
        self.batches = 0
        #: (start, end) of every batch on the system-wide monotonic clock, to line stages up
        self.spans: list[tuple[float, float]] = []
        self.live_bytes = 0
        self.peak_saved_bytes = 0
        self._storages: dict[int, int] = defaultdict(int)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.wall += end - start
            self.spans.append((start, end))
            self.batches += 1

    @contextlib.contextmanager
    def compute(self, inst: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy[type(inst).__name__] += time.perf_counter() - start

    def saved_tensors(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Count the activations saved for backward inside the block (``module``'s parameters,
        which autograd saves too, are model state and not counted)."""
        if not self.enabled:
            return contextlib.nullcontext()
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in params or nbytes == 0:
                return t
            self._storages[key] += 1
            if self._storages[key] == 1:
                self.live_bytes += nbytes
                self.peak_saved_bytes = max(self.peak_saved_bytes, self.live_bytes)
            packed = _Packed(t)
            weakref.finalize(packed, self._release, key, nbytes)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            return packed.tensor if isinstance(packed, _Packed) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, key: int, nbytes: int) -> None:
        self._storages[key] -= 1
        if self._storages[key] == 0:
            del self._storages[key]
            self.live_bytes -= nbytes

    def report(self) -> dict[str, Any]:
        busy = sum(self.busy.values())
        return {
            "wall_s": self.wall,
            "busy_s": busy,
            "busy_by_kind": dict(self.busy),
            "idle_fraction": 1.0 - busy / self.wall if self.wall else 0.0,
            "peak_saved_bytes": self.peak_saved_bytes,
            "batches": self.batches,
            "spans": list(self.spans),
        }

