"""Where stage 2-3's reduced gradient chunks land: a *gradient sink*, so the stage has one
reduction path whichever holds the gradients.

Each micro-step, a unit's bucket is reduce-scattered into the chunk :meth:`reduce_target` names,
then :meth:`add_grad` gets that chunk (averaged, post-scaled). Two sinks:

- :class:`GradShards` (the default): this rank's gradient shards in memory, one per unit, made
  at a batch's first reduction and handed back after the step. The first micro-step reduces
  straight into the shards; later ones (or a wider accumulation dtype) reduce into the bucket's
  own chunk and add it. With the optimizer offloaded
  (:meth:`~zkit.core.allocator.Allocator.grads_beside_master`) the shards are fp32 host buffers
  beside the master, filled by copies out of the buckets on the compute stream.
- :class:`StoreGrads`: a master store that takes the gradients itself (zkit-offload's NVMe store,
  :attr:`zkit.core.stores.MasterStore.takes_grads`): every chunk goes to its ``add_grad``.
- :class:`GradViews`: at one replica nothing is reduced and a unit's shard is the whole unit, so
  the shards are the parameters' gradients themselves, written in place
  (:class:`~zkit.zero.grad_buffers.GradBuffers`): no bucket, no chunk, no copy (``in_place``).
- :class:`ParamGrads`: at one replica, a master store in the training device's memory that takes
  the gradients (:attr:`~zkit.core.stores.MasterStore.shares_buffers`, zkit-offload's overlapped
  host step on a CPU-only run) gets each unit's parameters' ``.grad`` as autograd left them: no
  buffer to zero and accumulate into either, as plain PyTorch's step reads them.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from zkit.core.stores import MasterStore
from zkit.zero.flat import Unit
from zkit.zero.grad_buffers import GradBuffers


class GradShards:
    """The reduced gradient shards of ``units`` in memory (see the module docstring).

    Args:
        units: the partitioner's units (their shard sizes).
        allocator: gives and takes back the shards (purpose ``"grad"``, or ``"master_grad"``
            beside the master).
        accum_dtype, comm_dtype: the dtype gradients accumulate in, and the buckets' dtype.
        beside_master: the shards are fp32 host buffers beside an offloaded master.
        device: the training device (waited for before the host reads copied chunks).
    """

    #: the parameters' gradients are copied into buckets and reduced into the shards
    in_place = False

    def __init__(self, units: Sequence[Unit], allocator: Any, accum_dtype: torch.dtype, comm_dtype: torch.dtype,
                 beside_master: bool, device: torch.device) -> None:
        self.units, self.allocator, self.device = units, allocator, device
        self.accum_dtype, self.comm_dtype, self.beside_master = accum_dtype, comm_dtype, beside_master
        #: per unit, this rank's reduced gradient; empty between steps
        self.shards: list[torch.Tensor] = []
        #: beside the master: a later micro-step's chunks, added to the shards when backward ends
        self.staged: list[torch.Tensor] = []
        self.accumulated = False  # do the shards already hold earlier micro-steps of this batch?

    def _purpose(self) -> str:
        return "master_grad" if self.beside_master else "grad"

    def get(self, overwritten: bool = False) -> list[torch.Tensor]:
        """The shards, made if the batch has none yet; ``overwritten``: the caller is the batch's
        first reduction, which writes every shard whole (all units are reduced by the end of
        backward), so they need not be zeroed first."""
        if not self.shards:
            make = self.allocator.empty if overwritten else self.allocator.zeros
            dtype = torch.float32 if self.beside_master else self.accum_dtype
            self.shards = [make(u.shard, dtype, self._purpose()) for u in self.units]
        return self.shards

    def reduce_target(self, unit: int, chunk: torch.Tensor) -> torch.Tensor:
        """The shard itself at the first micro-step (unless through a wider dtype or beside the
        master), else the bucket's own ``chunk``: no landing area beyond the bucket."""
        straight = not self.accumulated and self.accum_dtype == self.comm_dtype and not self.beside_master
        # beside the master, the first micro-step's copies write the shards whole
        self.get(overwritten=not self.accumulated and (self.accum_dtype == self.comm_dtype or self.beside_master))
        return self.shards[unit] if straight else chunk

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Take ``grad`` (what :meth:`reduce_target` gave, reduced) into the shard."""
        if self.beside_master:
            # on the compute stream, so the bucket is not written again before the copy has read it
            if not self.accumulated:
                self.shards[unit].copy_(grad, non_blocking=True)
            else:
                if not self.staged:
                    self.staged = [self.allocator.empty(u.shard, torch.float32, "master_grad") for u in self.units]
                self.staged[unit].copy_(grad, non_blocking=True)
        elif grad is not self.shards[unit]:
            self.shards[unit].add_(grad)

    def end_backward(self) -> None:
        """Every unit of the micro-step is reduced."""
        if self.beside_master:
            # the copies out of the buckets were queued on the compute stream: the host reads the
            # shards (norm, step) and adds the staged micro-step only once they have landed
            if self.device.type != "cpu":
                torch.accelerator.synchronize(self.device)
            for shard, staged in zip(self.shards, self.staged):
                shard.add_(staged)
            for staged in self.staged:
                self.allocator.release(staged, "master_grad")
            self.staged = []
        self.accumulated = True

    def release(self) -> None:
        """Hand the shards back: the next reduction starts a new batch."""
        for shard in self.shards:
            self.allocator.release(shard, self._purpose())
        self.shards, self.accumulated = [], False


class StoreGrads:
    """Every reduced chunk goes to ``store.add_grad`` (a master store that
    :attr:`~zkit.core.stores.MasterStore.takes_grads`); nothing is held here."""

    beside_master = False
    in_place = False

    def __init__(self, store: MasterStore) -> None:
        self.store = store
        self.shards: list[torch.Tensor] = []  # none in memory
        self.staged: list[torch.Tensor] = []

    def get(self, overwritten: bool = False) -> list[torch.Tensor]:
        raise RuntimeError("the gradient shards are in the allocator's master store (NVMe offload), not in memory")

    def reduce_target(self, unit: int, chunk: torch.Tensor) -> torch.Tensor:
        """The bucket's own chunk: the store copies what it needs in :meth:`add_grad`."""
        return chunk

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        self.store.add_grad(unit, grad)

    def end_backward(self) -> None:
        """The store took every chunk already."""

    def release(self) -> None:
        """The partitioner's ``zero_grad`` tells the store itself."""


class GradViews:
    """At one replica, the shards are the parameters' gradients (see the module docstring): each
    ``.grad`` a view of its unit's buffer, accumulated in place by autograd over the micro-steps,
    held from the batch's first backward to the step."""

    beside_master = False
    in_place = True

    def __init__(self, buffers: GradBuffers) -> None:
        self.buffers = buffers
        self.staged: list[torch.Tensor] = []

    @property
    def shards(self) -> list[torch.Tensor]:
        return self.buffers.bufs if self.buffers.held else []

    def get(self, overwritten: bool = False) -> list[torch.Tensor]:
        return self.buffers.hold()

    def hold(self) -> None:
        """Before a backward: the buffers, and every ``.grad`` a view of them."""
        self.buffers.hold()

    def take(self, param: torch.Tensor) -> None:
        self.buffers.take(param)

    def unit_complete(self, unit: int) -> None:
        """``unit``'s gradients are complete for this micro-step: in its buffer already."""

    def reduce_target(self, unit: int, chunk: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("gradients written in place are not reduced through a bucket")

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        raise RuntimeError("gradients written in place are not reduced through a bucket")

    def end_backward(self) -> None:
        """The gradients are in the buffers already."""

    def release(self) -> None:
        self.buffers.release()


class ParamGrads:
    """At one replica, each unit's parameters' own gradients, as autograd made and accumulated them,
    handed to a master store that takes them where they are (see the module docstring)."""

    beside_master = False
    in_place = True
    shards: list[torch.Tensor] = []  # the store holds the gradients
    staged: list[torch.Tensor] = []

    def __init__(self, unit_params: Sequence[Sequence[torch.Tensor]], store: MasterStore) -> None:
        self.unit_params, self.store = unit_params, store

    def get(self, overwritten: bool = False) -> list[torch.Tensor]:
        raise RuntimeError("the gradients are the parameters' own, taken by the master store; there are no shards")

    def hold(self) -> None:
        """Nothing to prepare: autograd makes the gradients."""

    def take(self, param: torch.Tensor) -> None:
        """The gradient stays where autograd put it."""

    def unit_complete(self, unit: int) -> None:
        """``unit``'s gradients are complete for this micro-step: its parameters' gradients, in slot
        order (``None`` for one without), go to the store."""
        self.store.add_grad_in_place(unit, [p.grad for p in self.unit_params[unit]])

    def reduce_target(self, unit: int, chunk: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("gradients taken where autograd left them are not reduced through a bucket")

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        raise RuntimeError("gradients taken where autograd left them are not reduced through a bucket")

    def end_backward(self) -> None:
        """The store took every unit already."""

    def release(self) -> None:
        """The stage's ``zero_grad`` clears the parameters' ``.grad``."""
