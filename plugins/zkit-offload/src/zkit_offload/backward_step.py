"""The optimizer step run during the backward that ends a batch (``offload_optimizer.step_in_backward``).

With the master on NVMe, a step after backward reads every sub-group's master, gradient and
optimizer state and writes master and state back, and backward has just written those gradients
to the disk. But the gradients reach the master store in unit order (the bucketer launches the
reductions strictly in index order) and sub-groups pack whole units in that order, so sub-group
``i`` is complete the moment its last unit's gradient arrives. :class:`BackwardStep` steps it
then, while backward computes the next units:

* the gradients never go to the disk: 8 bytes a parameter a step less (4 written, 4 read back);
* the step's reads and writes run beside backward's compute instead of after it.

The update is the same as a step after backward, bit for bit, as long as nothing needs every
gradient before the first sub-group steps: the global norm for ``gradient_clipping`` and fp16's
overflow check. zkit-offload refuses those at initialize. A sub-group with a non-finite gradient
is not stepped, nor is any after it, and the engine stops the job at ``step()`` (it cannot skip a
step that is partly applied).

**Buffers.** The pipeline's ``buffer_count`` sets: sub-group ``i`` uses set ``i % buffer_count``.
Its gradient view fills as units arrive; its master and state are read ahead as soon as the
sub-group that used the set before has been written back; it steps when complete, and its master
and state are written back while the next sub-groups fill.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from zkit_offload.pipeline import HandleGroup, read_subgroup, write_subgroup

if TYPE_CHECKING:  # pragma: no cover
    from zkit_offload.swapped_master import SwappedMasterStore


class BackwardStep:
    """One batch's step, sub-group by sub-group as backward completes them (module docstring).

    Args:
        store: the master store whose sub-groups step.
        optimizer: the fused CPU optimizer over the partitioner's ``owned`` pieces.
        owned: the partitioner's ``(opt_param, unit, start, end, piece)`` records.
        publish: ``publish(unit, master)`` copies an updated unit into the model's parameters (or
            the parameter store); ``master`` is reused once it returns.
    """

    def __init__(self, store: "SwappedMasterStore", optimizer: Any, owned: Sequence[tuple[Any, ...]],
                 publish: Callable[[int, torch.Tensor], None]) -> None:
        self.store, self.optimizer, self.publish = store, optimizer, publish
        self.plan = store._plan(optimizer, owned)
        self.state = store.allocator._swapped_state(optimizer, self.plan)
        self.names = self.plan.state_names
        self.subgroups = store.subgroup_sizes()
        self.buffers = store.allocator.subgroup_buffers(self.subgroups)
        self.slots = len(self.buffers.sets)
        self.fresh = set(range(len(self.plan))) - self.state.on_disk
        self.group_of = self.state.groups_by_param(optimizer)
        self.reads: dict[int, HandleGroup] = {}
        self.writes: dict[int, HandleGroup] = {}
        self.arrived: list[set[int]] = [set() for _ in store.sizes]
        #: the sub-group whose gradients arrive now (every earlier one has stepped)
        self.current = 0
        self.stepped: list[int] = []
        #: a sub-group had a non-finite gradient: it and every later one stay as they were
        self.nonfinite = False
        self._read_ahead()  # the first sub-groups' reads run beside backward's first layers

    # -- gradients -------------------------------------------------------------------------------
    def grad_view(self, unit: int) -> torch.Tensor:
        """Where ``unit``'s gradient of this batch goes: its range of its sub-group's gradient buffer."""
        index, offset = self.store.unit_at[unit]
        if index != self.current:
            raise RuntimeError(
                f"step_in_backward: unit {unit}'s gradient (sub-group {index}) arrived while sub-group "
                f"{self.current} was filling; gradients must reach the master store in unit order"
            )
        self._read_ahead()
        grad = self.buffers.views(index % self.slots, {"grad": self.subgroups[index]["grad"]})["grad"]
        return grad[offset : offset + self.store.shard_sizes[unit]]

    def arrived_grad(self, unit: int) -> None:
        """``unit``'s gradient is in :meth:`grad_view`; step its sub-group if that completes it."""
        index, _ = self.store.unit_at[unit]
        self.arrived[index].add(unit)
        if len(self.arrived[index]) == len(self.store.units_of[index]):
            self._step(index)

    # -- the step --------------------------------------------------------------------------------
    def _start_read(self, i: int) -> None:
        before = self.writes.pop(i - self.slots, None)
        if before is not None:
            before.wait()  # its buffers are the ones about to be filled
        views = {name: t for name, t in self.buffers.views(i % self.slots, self.subgroups[i]).items() if name != "grad"}
        # never stepped: zeros, and bind() fills in the optimizer's initial state
        self.reads[i] = read_subgroup(self.store.swapper, i, views, self.names if i in self.fresh else ())

    def _read_ahead(self) -> None:
        """Start the reads of the sub-groups about to fill, as far as free buffers allow (never
        waiting on a write here: backward goes on)."""
        for i in range(self.current, min(len(self.subgroups), self.current + self.slots)):
            if i in self.reads or i in self.stepped:
                continue
            before = self.writes.get(i - self.slots)
            if before is not None and not before.done():
                return
            self._start_read(i)

    def _step(self, i: int) -> None:
        store = self.store
        self.current = i + 1
        if i not in self.reads:
            self._start_read(i)
        self.reads.pop(i).wait()
        if self.nonfinite or not all(math.isfinite(store._sq.get(u, 0.0)) for u in store.units_of[i]):
            self.nonfinite = True
            return
        views = self.buffers.views(i % self.slots, self.subgroups[i])
        with self.state.raw():
            store.step_subgroup(i, views, self.optimizer, self.state, self.group_of, 1.0, self.publish,
                                with_grad=self.arrived[i])  # all of them, unless finish() steps it
        self.writes[i] = write_subgroup(store.swapper, i, views, skip=("grad",))
        self.stepped.append(i)
        self._read_ahead()

    def finish(self, grad_factor: float) -> None:
        """``step()``: step what backward left (sub-groups with units that had no gradient) and
        wait for every write; raises the first I/O error."""
        if grad_factor != 1.0:
            self.abandon()
            raise RuntimeError(
                f"step_in_backward: the step was applied during backward with the gradients as they are, "
                f"but step() asks for them scaled by {grad_factor} (clipping or a loss scale)"
            )
        try:
            for i in range(self.current, len(self.subgroups)):
                self._step(i)
        finally:
            self.abandon()
        self.state.on_disk.update(self.stepped)

    def abandon(self) -> None:
        """Wait for every read and write in flight (raises the first error once all are done)."""
        pending = HandleGroup([*self.reads.values(), *self.writes.values()])
        self.reads.clear()
        self.writes.clear()
        pending.wait()
