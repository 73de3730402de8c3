"""What an allocator may hand the ZeRO partitioner besides buffers: stores that keep model states
out of memory (zkit-offload's NVMe files), and a step that runs around them.

The protocols say only what the partitioner needs of any store. What one store does besides
(zkit-offload steps sub-groups during the backward that ends a batch) reaches the kernel through
hooks (``zkit_before_backward``), not through members here.

:class:`zkit.core.allocator.Allocator` answers ``master_store``, ``param_shard_store`` and
``optimizer_stepper`` with ``None`` by default (everything in the allocator's buffers, the
partitioner steps the optimizer); an offload allocator returns one of these. Without one, the ZeRO
partitioner keeps its master and stage 3 its parameter shards in memory behind the same interfaces
(``zkit.zero.memory_store.InMemoryMasterStore``, ``zkit.zero.memory_param_store.InMemoryParamShardStore``),
so it has one code path for both.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

#: runs ``optimizer``'s step in place of ``optimizer.step()`` (its gradients are set and scaled)
OptimizerStepper = Callable[[torch.optim.Optimizer], None]


@runtime_checkable
class MasterStore(Protocol):
    """The fp32 master of every unit's shard and, where :attr:`takes_grads`, its gradients. One
    kept elsewhere (an allocator's, stages 2-3) leaves zero-stride placeholders in the partitioner's
    ``self.master``."""

    #: whether the store accumulates the reduced gradient shards (:meth:`add_grad`, stages 2-3);
    #: if not, the stage keeps them and the store reads them at the step
    takes_grads: bool

    #: whether the store can step the parameters' own fp32 shards as its master and take the
    #: parameters' gradients where autograd leaves them (:meth:`share_master`,
    #: :meth:`add_grad_in_place`): where the store's memory is the training device's (a CPU-only
    #: run), so no copy either way
    shares_buffers: bool

    def share_master(self, shards: Sequence[torch.Tensor]) -> None:
        """Offered when :attr:`shares_buffers` and the parameters are fp32 on the store's device:
        per unit, this rank's shard of the parameters, to be the master itself (stepped in place,
        nothing published). Called once, before :meth:`bind`; :meth:`write_master` is not called."""

    def add_grad_in_place(self, unit: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Where :attr:`shares_buffers` at one replica with gradients of the master's dtype:
        ``grads`` are ``unit``'s parameters' own gradients in slot order (``None`` for one without),
        as autograd accumulated the batch's micro-steps so far, untouched until :meth:`zero_grad`;
        called at each micro-step once the unit's gradients are complete (in place of :meth:`add_grad`)."""

    def write_master(self, unit: int, values: torch.Tensor) -> None:
        """New fp32 values of ``unit``'s master shard; ``values`` may be reused on return (it may
        also be what :meth:`read_master` returned)."""

    def read_master(self, unit: int) -> torch.Tensor:
        """``unit``'s master shard in host memory: a copy, or the shard itself where the store keeps
        it in memory (write to it, then :meth:`write_master` it, and both cases are served)."""

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Add one micro-step's reduced gradient shard (any device, any float dtype) to what the
        batch accumulated; ``grad`` may be reused on return."""

    def grad_norm_sq(self) -> float | torch.Tensor:
        """Squared L2 norm of this rank's accumulated gradients (a tensor where they are on the
        training device, so the host need not wait for it)."""

    def grads_finite(self) -> bool | torch.Tensor:
        """Whether this rank's accumulated gradients are all finite."""

    def zero_grad(self) -> None:
        """The next :meth:`add_grad` of every unit starts a new batch."""

    def skip_step(self) -> None:
        """The batch is skipped (its loss or gradients were not finite): the partitioner calls
        :meth:`zero_grad` next. A store that already applied part of the step (a plugin that steps
        parts of the batch during backward, through its own hooks) raises
        :class:`FloatingPointError` saying so, as :meth:`zkit.core.partitioner.Partitioner.skip_step` does."""

    def bind(self, optimizer: torch.optim.Optimizer, owned: Sequence[tuple[Any, ...]]) -> None:
        """The partitioner built ``optimizer`` over its ``owned`` pieces (made from ``self.master``);
        called once, before any step."""

    def step(self, optimizer: torch.optim.Optimizer, owned: Sequence[tuple[Any, ...]], grad_factor: float,
             publish: Callable[[int, torch.Tensor], None]) -> None:
        """Step ``optimizer`` over the partitioner's ``owned`` pieces and copy every updated unit's
        master into the parameters: ``publish(unit, master)`` returns once ``master`` may be
        reused (a store whose masters stay put may copy without that wait)."""


@runtime_checkable
class ParamShardStore(Protocol):
    """Where stage-3 parameter shards live: in memory by default, or kept elsewhere by an
    allocator's store and read ahead of the gathers that use them (``zkit/zero/sharded_params.py``
    is the only caller besides stage 3's set-up)."""

    #: the shards' dtype (``None`` for the in-memory store: each shard tensor has its own)
    dtype: torch.dtype | None
    #: how many units past the gathered ones stage 3 asks to :meth:`prefetch`
    lookahead: int
    #: the shards are not tensors in memory (``su.shard`` is ``None``): the optimizer cannot step
    #: them in place (the fp32 master is a copy) nor write them itself; :meth:`put` stores them
    shards_leave_memory: bool
    #: :meth:`get` may wait for a gather in flight to free a buffer: stage 3 then issues its
    #: gathers one by one, never as one batch (a batch is waited for only after it is issued)
    may_wait_for_buffer: bool

    def adopt(self, units: Sequence[Any]) -> None:
        """Take the shards of these :class:`~zkit.zero.sharded_params.ShardedUnit` s: ``su.stored_in(self)``
        for each shard it keeps, ``su.shard_to_memory()`` for one another store held."""

    def take(self, su: Any, allocator: Any = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """Give ``su``'s shard back as a tensor (into ``into`` or a new ``allocator`` buffer)."""

    def prefetch(self, su: Any) -> None:
        """Start reading ``su``'s shard (best effort)."""

    def ready(self, su: Any) -> bool:
        """Whether ``su``'s shard is in host memory now: :meth:`get` would not wait for a read."""

    def get(self, su: Any) -> torch.Tensor:
        """``su``'s shard in host memory, held until :meth:`release`."""

    def release(self, su: Any) -> None:
        """The gather that read ``su``'s shard is done with it, and so is any copy from it."""

    def put(self, su: Any, values: torch.Tensor) -> None:
        """New values of ``su``'s shard."""
