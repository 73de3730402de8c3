"""What a training step costs the host, counted on any device: the ops it dispatches, the host-device
syncs among them and its collectives.

On an accelerator each op dispatched is about one kernel launch, and each read of a device
tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``, a data-dependent shape) waits
for the device to drain. Both are visible on the CPU too, where a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` around one step sees every op the step
dispatches: forward, backward (on the CPU autograd runs it on the calling thread) and the
optimizer. So a step's host cost is counted, deterministically, without a GPU::

    counts = count_step(lambda: train_step(batch))
    counts.ops, counts.syncs, counts.collectives

What counts as what:

* ``ops``: every op the step dispatched on the calling thread (aten, c10d and any other
  namespace); ops run by other threads (a copy thread, a kernel's worker pool) are not seen. A
  tensor autograd saves or unpacks is copied as a TensorImpl (no op), a copy that reaches an
  active mode as a ``detach``: not counted, so the counts are torch profiler's, which sees none.
* ``syncs``: :data:`SYNC_OPS` on a tensor that would live on the accelerator in a GPU run;
  ``host_reads``: the same ops on a tensor that would live in host memory there (an offloaded
  optimizer's state and fp32 master), which wait for nothing but still dispatch. A tensor is
  host-resident when ``host_resident(tensor)`` says so (default: none is, every such op is a
  sync) or, on a real accelerator, when it is on the CPU.
* ``collectives``: ops of the distributed namespaces (:data:`COLLECTIVE_NAMESPACES`): the
  collectives the step issued, counted where they are dispatched.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, TypeVar

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ops that read a tensor's value on the host: a host-device sync on a device tensor
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal"})
#: the namespaces of torch.distributed's collectives (eager and functional)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})

T = TypeVar("T")
_DETACH = torch.ops.aten.detach.default
#: excluded while an op runs through the dispatcher on its way to a mode, not when a mode is called
#: straight from a tensor's shallow copy
_DISPATCHED = torch._C.DispatchKey.PythonTLSSnapshot


@attrs.frozen
class StepCounts:
    """One step's counts (see the module docstring); ``by_op`` maps each op's name
    (``"aten::add_"``) to how often it ran, ``syncs_by_op`` the same for the syncs alone."""

    ops: int
    syncs: int
    host_reads: int
    collectives: int
    by_op: dict[str, int] = attrs.field(factory=dict, eq=False, repr=False)
    syncs_by_op: dict[str, int] = attrs.field(factory=dict, eq=False)


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active (``with OpCounter() as c: ...``; then
    :meth:`counts`). ``host_resident(tensor)`` says which tensors would be in host memory on an
    accelerator (their value reads are not syncs)."""

    def __init__(self, host_resident: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self.host_resident = host_resident
        self.by_op: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DETACH and not torch._C._dispatch_tls_is_dispatch_key_excluded(_DISPATCHED):
            # Not dispatched: autograd saving or unpacking a tensor copies its TensorImpl, and only
            # while a mode is active does that copy reach the mode, as a detach; without one it is
            # no op (torch's profiler sees none).
            return func(*args, **(kwargs or {}))
        name = func._schema.name
        self.by_op[name] += 1
        if name in SYNC_OPS:
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if tensor is not None and self._on_host(tensor):
                self.host_reads += 1
            else:
                self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    def _on_host(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "cpu" and torch.accelerator.is_available():
            return True
        return self.host_resident is not None and bool(self.host_resident(tensor))

    def counts(self) -> StepCounts:
        collectives = sum(n for op, n in self.by_op.items() if op.split("::")[0] in COLLECTIVE_NAMESPACES)
        return StepCounts(
            ops=sum(self.by_op.values()),
            syncs=sum(self.syncs.values()),
            host_reads=self.host_reads,
            collectives=collectives,
            by_op=dict(self.by_op),
            syncs_by_op=dict(self.syncs),
        )


def count_step(step: Callable[[], T], host_resident: Callable[[torch.Tensor], bool] | None = None
               ) -> tuple[StepCounts, T]:
    """Run ``step()`` once under an :class:`OpCounter`: its counts and what it returned."""
    with OpCounter(host_resident) as counter:
        out = step()
    return counter.counts(), out


def storages_of(tensors) -> Callable[[torch.Tensor], bool]:
    """A ``host_resident`` predicate: whether a tensor shares storage with one of ``tensors()``
    (called at each value read, so tensors made during the step are seen)."""

    def resident(tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ptr for t in tensors() if t.numel())

    return resident
