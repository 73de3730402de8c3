"""ZeRO-Offload overlapped: the host optimizer steps each unit during the backward that ends a
batch, as soon as its gradients have arrived (``offload_optimizer.step_in_backward`` with device
``cpu``).

Without it, a step with the optimizer on the host runs in sequence: backward, then every
gradient to the host, then the whole host step, then every updated unit back to the device. With
it, the partitioner's reduced gradient of each unit comes to :meth:`HostMasterStore.add_grad` (the
store *takes* the gradients, :attr:`~zkit.core.stores.MasterStore.takes_grads`), which

1. copies it into the unit's fp32 host gradient on the allocator's copy queue (the side stream on
   an accelerator, into pinned memory), the compute stream waiting for that copy before it writes
   the bucket again, and the host not at all;
2. at the batch's last backward, hands the unit to a host thread (:class:`HostStepper`) that waits
   for that copy, adds the batch's earlier micro-steps, and steps the unit's pieces
   (``fused_step(params=...)``) while backward computes the next units;
3. once the thread has stepped a unit, issues the copy of its master into the parameters on the
   copy queue (``publish_unit``, no wait; the gathers and the next forward wait for it).

Units reach the store in index order, which is the order backward completes them, so the step of
the first units runs beside the backward of the rest.

On a CPU-only run with fp32 parameters there is no trip between device and host to make
(:attr:`HostMasterStore.shares_buffers`): the partitioner hands over the parameters' shards as the
master (:meth:`~HostMasterStore.share_master`: stepped in place, nothing published) and, at one
replica, each unit's parameters' own gradients as autograd left them
(:meth:`~HostMasterStore.add_grad_in_place`): the store copies nothing, as the step after backward. The update is the same as the step after
backward, bit for bit, provided nothing needs every gradient before the first unit steps:

* **clipping** scales every gradient by the global norm, known after the last gradient;
  ``gradient_clipping`` with ``step_in_backward`` is refused at initialize, naming both (DeepSpeed's
  ``super_offload`` does not step early when it clips either);
* **fp16** skips a step whose gradients overflowed and rescales; refused at initialize;
* a **non-finite** loss or gradient (bf16, fp32) skips the step: each unit's master and optimizer
  state are copied aside before it steps, and a skipped step puts them back and returns the
  parameters as they were, so the run equals the one stepping after backward, skipped step
  included. That costs one more copy of master and optimizer state in host memory (12 bytes a
  parameter with Adam) and a copy pass per step, on the host thread, for every unit as the last
  backward begins (the thread is idle until the first unit arrives). Each unit's step takes its
  gradients' L2 norms, from which :meth:`HostMasterStore.grads_finite` answers without a pass.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from zkit.zero import StreamCopy, attach_copy_outs

if TYPE_CHECKING:  # pragma: no cover
    from zkit_offload.allocators import HostAllocator

_KEY = "zero_optimization.offload_optimizer.step_in_backward"


class HostStepper:
    """Runs host steps one after another, in the order given: on a thread of its own (``threaded``),
    or on the caller's thread at once (for tests that check orderings step by step)."""

    def __init__(self, threaded: bool = True) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zkit-host-step") if threaded else None

    def submit(self, fn: Callable[[], None]) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn)
        done: Future = Future()
        try:
            fn()
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits, as the thread's would be
            done.set_exception(exc)
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _Undo:
    """Each stepped unit's master and optimizer state as they were before its step (see the module
    docstring): buffers made once, reused every step."""

    def __init__(self, store: "HostMasterStore") -> None:
        self.store = store
        self.master: list[torch.Tensor | None] = [None] * len(store.master)
        self.state: dict[int, dict[str, np.ndarray]] = {}
        self.fresh: set[int] = set()  # pieces (id of the opt param) without state before this step

    def save(self, unit: int, optimizer: Any, members: Sequence[torch.Tensor]) -> None:
        if self.master[unit] is None:
            self.master[unit] = self.store.allocator.empty(self.store.shard_sizes[unit], torch.float32, "master")
        np.copyto(self.master[unit].numpy(), self.store.master[unit].numpy())
        for p in members:
            state = optimizer.state.get(p)
            if not state:
                self.fresh.add(id(p))
                continue
            kept = self.state.setdefault(id(p), {})
            for name in ("step", *optimizer._state_names):
                src = optimizer.array(state[name])
                if name not in kept or kept[name].shape != src.shape:
                    kept[name] = np.empty_like(src)
                np.copyto(kept[name], src)

    def restore(self, unit: int, optimizer: Any, members: Sequence[torch.Tensor]) -> None:
        np.copyto(self.store.master[unit].numpy(), self.master[unit].numpy())
        for p in members:
            if id(p) in self.fresh:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for name, kept in self.state[id(p)].items():
                np.copyto(optimizer.array(state[name]), kept)

    def clear(self) -> None:
        self.fresh.clear()


class _BackwardStep:
    """One batch's step, unit by unit as the last backward delivers their gradients."""

    def __init__(self, store: "HostMasterStore", optimizer: Any, members: list[list[torch.Tensor]],
                 publish: Callable[[int, torch.Tensor], None]) -> None:
        self.store, self.optimizer, self.members, self.publish = store, optimizer, members, publish
        self.running: list[tuple[int, Future]] = []  # submitted, not yet published, in unit order
        self.stepped: list[int] = []
        #: each unit's gradient norms, taken by its host step (the verdict without another pass)
        self.norms: list[list[torch.Tensor] | None] = [None] * len(members)
        # Every unit is copied aside now, before backward has delivered any: the host thread is
        # idle until the first unit arrives, and a unit's step then waits for nothing but its
        # gradient (the last one's is what the batch waits for).
        self.saved = [store.stepper.submit(lambda u=u: store.undo.save(u, optimizer, members[u]))
                      for u in range(len(members))]

    def arrived(self, unit: int, copy: Any, staged: torch.Tensor | None) -> None:
        """``unit``'s last gradient of the batch is on its way (``copy``): step it on the host
        thread once it has landed, then publish it."""
        store, optimizer, members = self.store, self.optimizer, self.members[unit]

        def step() -> None:
            if copy is not None:
                copy.synchronize()  # the gradient has landed in host memory
            if staged is not None:  # an earlier micro-step of the batch is in the gradient already
                store.grads[unit].add_(staged)
            self.saved[unit].result()  # done: it came first on this thread (its error, if any, here)
            grads = [g for g in store.unit_grads[unit] if g.numel()]
            if grads:
                self.norms[unit] = torch._foreach_norm(grads, 2, dtype=torch.float32)
            if members:
                optimizer.fused_step(1.0, params=members)
            store.log("step", unit)

        self.running.append((unit, store.stepper.submit(step)))
        self.publish_done()

    def publish_done(self, wait: bool = False) -> None:
        """Publish (on this thread: copies are issued here only) the units the host thread has
        stepped, in order; with ``wait``, all of them."""
        while self.running and (wait or self.running[0][1].done()):
            unit, done = self.running.pop(0)
            done.result()  # the host thread's error, if any, here
            self.stepped.append(unit)
            if not (self.store.copy_out or self.store.master_is_param):  # else the step wrote the parameters
                self.store.log("publish", unit)
                self.publish(unit, self.store.master[unit])

    def finish(self) -> None:
        try:
            self.publish_done(wait=True)
        finally:
            for _, pending in self.running:  # an error left some: let them end before going on
                pending.exception()
            for pending in self.saved:
                pending.exception()
            self.running = []

    def verdict(self) -> torch.Tensor | None:
        """Whether every gradient is finite, from the norms the steps took (the store's
        :meth:`~HostMasterStore.grads_finite` without its pass); ``None`` where a unit was not stepped."""
        self.finish()
        if len(self.stepped) != len(self.members):
            return None
        norms = [n for unit in self.norms if unit is not None for n in unit]
        if not norms:
            return torch.tensor(True, device="cpu")
        return torch.isfinite(norms[0] if len(norms) == 1 else torch.stack(norms).sum())

    def undo(self) -> None:
        """Put every stepped unit's master and state back, and its parameters."""
        self.finish()
        for unit in self.stepped:
            self.store.undo.restore(unit, self.optimizer, self.members[unit])
            if not self.store.master_is_param:
                self.publish(unit, self.store.master[unit])


class HostMasterStore:
    """The fp32 master and its gradients in host memory, stepped during backward (module
    docstring); the :class:`~zkit.core.stores.MasterStore` of the ``host`` allocator with
    ``step_in_backward``.

    Args:
        allocator: the host allocator (its buffers, pinned on an accelerator, and copy queue).
        shard_sizes: elements of this rank's shard of each unit, in unit order.
    """

    takes_grads = True
    step_in_backward = True
    #: host memory is a CPU-only run's training memory: the partitioner may hand over the fp32
    #: parameters as the master and the gradient buffers themselves (:meth:`share_master`,
    #: :meth:`add_grad_in_place`), which the step then works on where they are, as the step after
    #: backward does, with no copy in or out
    shares_buffers = True

    def __init__(self, allocator: "HostAllocator", shard_sizes: Sequence[int]) -> None:
        self.allocator = allocator
        self.shard_sizes = [int(n) for n in shard_sizes]
        self._starts = np.cumsum([0, *self.shard_sizes]).tolist()
        flat = allocator.empty(sum(self.shard_sizes), torch.float32, "master")
        self.master = self._split(flat)
        #: whether the master is the parameters' own shards (:meth:`share_master`)
        self.master_is_param = False
        #: per unit, its gradient of the batch in host buffers of the store's own, made at the first
        #: :meth:`add_grad` (none where the gradients are taken in place)
        self.grads: list[torch.Tensor | None] = [None] * len(self.shard_sizes)
        #: per unit, the tensors its gradient is in: its buffer, or the parameters' own gradients
        self.unit_grads: list[list[torch.Tensor]] = [[] for _ in self.shard_sizes]
        #: per unit, its pieces (optimizer parameter, start, end in the shard), in shard order
        self._pieces: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in self.shard_sizes]
        self._zeros: dict[int, torch.Tensor] = {}  # a zero gradient for a piece whose parameter had none
        #: a later micro-step's gradients, until they are added (made at the first such micro-step)
        self.staged: list[torch.Tensor] | None = None
        self.stepper = HostStepper()
        self.undo = _Undo(self)
        self._accumulated = False  # do the gradients hold an earlier micro-step of this batch?
        self._arrived = 0  # units delivered in this micro-step
        self._copies: list[Any] = []  # this micro-step's gradient copies, until it ends
        self._members: list[list[torch.Tensor]] = [[] for _ in self.shard_sizes]
        self._backward_step: _BackwardStep | None = None
        #: whether the step writes the 16-bit parameters itself (``None``: not decided yet)
        self.copy_out: bool | None = None
        #: ``listener(event, unit)``, when someone listens: ``"grad"`` (a unit's gradients arrived;
        #: its copy, if any, is the next one the copy queue issues), ``"step"`` (the host thread
        #: stepped it), ``"publish"`` (its parameters' copy is about to be issued)
        self.listener: Callable[[str, int], None] | None = None

    def log(self, event: str, unit: int) -> None:
        if self.listener is not None:
            self.listener(event, unit)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in zip(self._starts, self._starts[1:])]

    # -- the master ------------------------------------------------------------------------------
    def share_master(self, shards: Sequence[torch.Tensor]) -> None:
        """The fp32 parameters' shards are the master (a CPU-only run): the store's own goes back."""
        if self.master:
            self.allocator.release(self.master[0]._base if self.master[0]._base is not None else self.master[0],
                                   "master")
        self.master = [s.view(-1) for s in shards]
        self.master_is_param = True

    def write_master(self, unit: int, values: torch.Tensor) -> None:
        self.master[unit].copy_(values.reshape(-1))

    def read_master(self, unit: int) -> torch.Tensor:
        """The shard itself (no copy): writes to it are the master's."""
        return self.master[unit]

    def bind(self, optimizer: torch.optim.Optimizer, owned: Sequence[tuple[Any, ...]]) -> None:
        """Point the optimizer's pieces (placeholders the partitioner made) at the master and
        their gradients at the host gradient buffers: made once."""
        from zkit_offload.cpu_optimizer import FusedCPUOptimizer

        if not isinstance(optimizer, FusedCPUOptimizer):
            raise ValueError(
                f"{_KEY} steps each unit's pieces on their own during backward, which only zkit-offload's fused "
                f"CPU optimizers do (config types Adam, AdamW, Adagrad, Lion); got {type(optimizer).__name__}. "
                "Use one of those, or drop step_in_backward"
            )
        for opt_param, unit, a, b, _ in owned:
            opt_param.data = self.master[unit][a:b].view(opt_param.shape)
            self._pieces[unit].append((opt_param, a, b))
            self._members[unit].append(opt_param)
        for pieces in self._pieces:
            pieces.sort(key=lambda piece: piece[1])

    def _use_grad(self, unit: int, grad: torch.Tensor) -> None:
        """``grad`` holds ``unit``'s gradients from now on: the unit's pieces' ``.grad`` are its views."""
        self.grads[unit] = grad
        self.unit_grads[unit] = [grad]
        for opt_param, a, b in self._pieces[unit]:
            opt_param.grad = grad[a:b].view(opt_param.shape)

    def _own_grads(self) -> list[torch.Tensor]:
        """The store's own fp32 gradient buffers, made the first time a gradient is copied in."""
        if any(g is None for g in self.grads):
            flat = self.allocator.empty(sum(self.shard_sizes), torch.float32, "master_grad")
            for unit, grad in enumerate(self._split(flat)):
                self._use_grad(unit, grad)
        return self.grads  # type: ignore[return-value]

    # -- gradients -------------------------------------------------------------------------------
    def begin_last_backward(self, optimizer: Any, owned: Sequence[tuple[Any, ...]],
                            publish: Callable[[int, torch.Tensor], None],
                            target: Callable[[int], torch.Tensor | None] | None = None) -> None:
        """The backward that ends a batch is about to run: step each unit once its gradient has
        arrived; ``publish(unit, master)`` returns the updated unit without waiting. ``target(unit)``:
        where the unit's parameters are (the partitioner's ``publish_target``): 16-bit ones in host
        memory are written by the step's own pass, as the in-memory store's copy-out does."""
        if target is not None and self.copy_out is None:
            # the fp32 parameters themselves are stepped where they are the master
            self.copy_out = False if self.master_is_param else attach_copy_outs(optimizer, owned, target)
        if self._backward_step is not None:
            raise RuntimeError(
                f"{_KEY}: a second backward ends the batch before step(); the first one has already stepped the units "
                "its gradients completed, so the gradients of this one would be lost. Call step() after each "
                "batch's last backward"
            )
        self._backward_step = _BackwardStep(self, optimizer, self._members, publish)

    @property
    def stepped_in_backward(self) -> bool:
        """Whether this batch's step began during backward."""
        return self._backward_step is not None

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        """One micro-step's reduced gradient of ``unit``: to the host on the copy queue; ``grad``
        may be written again once this returns (the compute stream waits for the copy)."""
        staged = None
        if self._accumulated:
            if self.staged is None:
                self.staged = [self.allocator.empty(n, torch.float32, "master_grad") for n in self.shard_sizes]
            staged = self.staged[unit]
        grads = self._own_grads()
        self.log("grad", unit)
        copy = self.allocator.copies.copy(staged if staged is not None else grads[unit], grad.reshape(-1))
        self._arrived += 1
        if self._backward_step is not None:
            self._backward_step.arrived(unit, copy, staged)
        else:
            self._copies.append(copy)
        if isinstance(copy, StreamCopy):
            copy.hold_source()
        if self._arrived == len(self.shard_sizes):
            self._end_micro_step()

    def add_grad_in_place(self, unit: int, grads: Sequence[torch.Tensor | None]) -> None:
        """``unit``'s parameters' own gradients, the micro-steps accumulated into them by autograd
        (see :attr:`shares_buffers`): each piece's ``.grad`` is its parameter's, nothing copied or
        added; at the batch's last backward the unit steps."""
        pieces = self._pieces[unit]
        if len(grads) != len(pieces):  # one replica: a piece is a whole parameter
            raise RuntimeError(f"unit {unit} has {len(pieces)} pieces but {len(grads)} gradients came")
        taken = []
        for (opt_param, _, _), grad in zip(pieces, grads):
            if grad is None:  # a parameter this batch did not reach steps on a zero gradient, as a shard's
                grad = self._zeros.get(id(opt_param))
                if grad is None:
                    grad = self._zeros[id(opt_param)] = torch.zeros_like(opt_param)
            elif grad.shape != opt_param.shape:
                grad = grad.view(opt_param.shape)
            opt_param.grad = grad
            taken.append(grad)
        self.unit_grads[unit] = taken
        self.log("grad", unit)
        self._arrived += 1
        if self._backward_step is not None:
            self._backward_step.arrived(unit, None, None)
        if self._arrived == len(self.shard_sizes):
            self._arrived = 0

    def _end_micro_step(self) -> None:
        """Every unit of the micro-step has arrived: outside the last backward, add it to the batch."""
        self._arrived = 0
        copies, self._copies = self._copies, []
        for copy in copies:
            copy.synchronize()
        if self._backward_step is None and self._accumulated:
            for grad, staged in zip(self.grads, self.staged or []):
                grad.add_(staged)
        self._accumulated = True

    def _settled_grads(self) -> list[torch.Tensor]:
        """The batch's gradient tensors, once every copy and step in flight has finished."""
        if self._backward_step is not None:
            self._backward_step.finish()
        return [g for grads in self.unit_grads for g in grads]

    def grad_norm_sq(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device="cpu")  # the gradients are host tensors
        for g in self._settled_grads():
            sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        return sq

    def grads_finite(self) -> torch.Tensor:
        """One read pass over the host gradients (see the in-memory store's), or none where this
        batch's units stepped during backward: each step took its unit's norm."""
        early = self._backward_step.verdict() if self._backward_step is not None else None
        if early is not None:
            return early
        shards = [g for g in self._settled_grads() if g.numel()]
        if not shards:
            return torch.tensor(True, device="cpu")
        norms = torch._foreach_norm(shards, 2, dtype=torch.float32)
        return torch.isfinite(norms[0] if len(norms) == 1 else torch.stack(norms).sum())

    def zero_grad(self) -> None:
        """The next :meth:`add_grad` of every unit starts a new batch."""
        self._accumulated = False
        self._arrived = 0
        self._copies = []
        for unit, grad in enumerate(self.grads):
            if grad is None:  # the parameters' own gradients: let them go with the parameters' ``.grad``
                self.unit_grads[unit] = []
                for opt_param, _, _ in self._pieces[unit]:
                    opt_param.grad = None

    def skip_step(self) -> None:
        """The batch is skipped: the units stepped in backward get their master, optimizer state
        and parameters back."""
        early, self._backward_step = self._backward_step, None
        if early is not None:
            early.undo()
            self.undo.clear()

    # -- the step --------------------------------------------------------------------------------
    def step(self, optimizer: Any, owned: Sequence[tuple[Any, ...]], grad_factor: float,
             publish: Callable[[int, torch.Tensor], None]) -> None:
        """Finish the step begun in backward; without one (the engine's hook did not run), step
        every unit now."""
        early, self._backward_step = self._backward_step, None
        if early is not None:
            if grad_factor != 1.0:
                early.undo()
                raise RuntimeError(f"{_KEY}: the step was applied during backward with the gradients as they are, "
                                   f"but step() asks for them scaled by {grad_factor} (clipping or a loss scale)")
            early.finish()
            self.undo.clear()
            return
        optimizer.fused_step(grad_factor)
        if not self.master_is_param:
            for unit, master in enumerate(self.master):
                publish(unit, master)

    def close(self) -> None:
        self.stepper.close()
