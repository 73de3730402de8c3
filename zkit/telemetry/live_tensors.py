"""Measure what is really held: the bytes of every tensor storage alive in this process.

Allocator counters say what a component *asked* for; this walks the garbage collector's objects
instead, so a buffer that nobody accounts for (a scratch bucket kept between steps, gradients an
optimizer holds on to) shows up too. Each storage is counted once, however many views of it
exist. It costs a pass over all Python objects: use it in tests and benchmarks, not every step.
"""
from __future__ import annotations

import gc
import warnings

import torch


def live_tensor_bytes(device: str | torch.device | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from Python objects (on ``device`` only,
    when given). Parameters, gradients (``.grad``), optimizer state and views all count once."""
    want = torch.device(device) if device is not None else None
    seen: dict[tuple[str, int], int] = {}

    def note(t: torch.Tensor) -> None:
        if t.is_meta or (want is not None and t.device.type != want.type):
            return
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            # sparse or otherwise storage-less tensors, and the fake tensors a torch.compile'd
            # module's caches keep alive (they hold no memory)
            return
        if ptr:
            seen[(str(t.device), ptr)] = storage.nbytes()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if _is_tensor(o)]
    for obj in objects:
        note(obj)
        if obj.is_leaf and obj.grad is not None:  # a .grad may have no Python object of its own
            note(obj.grad)
    return sum(seen.values())


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a dead weak proxy
        return False
