"""The fp32 master and its gradients on NVMe, next to the optimizer state (ZeRO-Infinity).

With ``offload_optimizer.device == "nvme"`` at ZeRO stages 2 and 3, the partitioner asks its
allocator for a *master store* (``master_store(shard_sizes)``, one size per unit) and from then on
keeps no fp32 master and no gradient shard in memory: host memory holds a few buffers whatever the
model size, which is what lets a model far larger than host memory train.

**Layout.** The units' shards, in unit order, each starting on a :data:`~zkit_offload.swap.ALIGN`
boundary (direct I/O writes a unit without touching its neighbours), are packed into sub-groups of
about ``sub_group_size`` elements; a larger unit is a sub-group on its own. Each sub-group has one
swap file per tensor, all with this layout: ``master``, ``grad`` and the optimizer's state
(``exp_avg``, ``exp_avg_sq``...), so one step reads everything a sub-group needs.

**Gradients.** :meth:`SwappedMasterStore.add_grad` takes a unit's reduced gradient shard of one
micro-step, converts it to fp32 in one of two staging buffers (adding what the file holds when an
earlier micro-step of the batch wrote the unit), notes its squared norm for clipping and the
overflow check, and writes it back asynchronously while backward goes on.

**Step in backward.** With ``offload_optimizer.step_in_backward``, the plugin's
``zkit_before_backward`` hook calls :meth:`SwappedMasterStore.begin_last_backward` before the
backward that ends a batch, and each
sub-group steps as soon as its gradients are complete (:mod:`zkit_offload.backward_step`): the
gradients of that micro-step stay in host buffers instead of going to the disk.

**Step.** :meth:`SwappedMasterStore.step` runs the sub-group pipeline
(:func:`~zkit_offload.pipeline.step_in_subgroups`): read master, gradient and state of sub-group
``i+1`` while ``i`` steps and ``i-1`` is written back. During a sub-group's step its optimizer
parameters point into the read buffers; in between they are zero-stride placeholders of the right
shape (``p.shape`` answers, no memory), and the partitioner's ``publish(unit, master)`` copies
each updated unit into the model's parameters (or the parameter store).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Container, Sequence

import torch

from zkit.zero import pack_aligned
from zkit.host_memory import trim
from zkit_offload.backward_step import BackwardStep
from zkit_offload.io_memory import ALIGN_ELEMS  # noqa: F401 - every unit starts on such a block
from zkit_offload.pipeline import subgroup_key
from zkit_offload.swap import ALIGN, SwapHandle, _round_up, aligned_empty
from zkit_offload.swapped_state import SubGroupPlan

if TYPE_CHECKING:  # pragma: no cover
    from zkit_offload.allocators import NVMeAllocator



def placeholder(shape: torch.Size | Sequence[int]) -> torch.Tensor:
    """A zero-stride fp32 tensor of ``shape`` backed by one element (no memory for the values)."""
    return torch.empty((), dtype=torch.float32, device="cpu").expand(tuple(shape))


class SwappedMasterStore:
    """fp32 master shards and their gradients in swap files (module docstring).

    Args:
        allocator: the NVMe allocator (its optimizer swapper, sub-group pipeline and byte counts).
        shard_sizes: elements of this rank's shard of each unit, in unit order.
        sub_group_size: elements per sub-group.
    """

    #: every micro-step's reduced gradient shard comes to :meth:`add_grad`
    takes_grads = True
    #: master and gradients live in files: nothing in memory to share
    shares_buffers = False

    def __init__(self, allocator: "NVMeAllocator", shard_sizes: Sequence[int], sub_group_size: int) -> None:
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be at least 1 element, got {sub_group_size}")
        self.allocator = allocator
        self.swapper = allocator.swapper
        self.shard_sizes = [int(n) for n in shard_sizes]
        #: per unit: (sub-group, offset in elements); per sub-group: size and units
        self.unit_at, self.sizes = pack_aligned(self.shard_sizes, ALIGN_ELEMS, sub_group_size)
        self.units_of: list[list[int]] = [[] for _ in self.sizes]
        for unit, (index, _) in enumerate(self.unit_at):
            self.units_of[index].append(unit)
        for i, n in enumerate(self.sizes):
            for name in ("master", "grad"):
                self.swapper.register(subgroup_key(i, name), n * 4)
        largest = max((_round_up(n, ALIGN_ELEMS) for n in self.shard_sizes), default=0)
        self._staging = [aligned_empty(largest, torch.float32) for _ in range(2)]
        self._staging_write: list[SwapHandle | None] = [None, None]
        self._turn = 0
        allocator.track("master_grad", sum(b.numel() * 4 for b in self._staging))
        self._unit_write: dict[tuple[str, int], SwapHandle] = {}
        self._sq: dict[int, float] = {}  # unit -> squared norm of its gradient so far this batch
        self.plan: SubGroupPlan | None = None
        self._state_names: tuple[str, ...] = ()
        #: ``offload_optimizer.step_in_backward``: step sub-groups during the batch's last backward
        self.step_in_backward = bool(allocator.optimizer_config.step_in_backward)
        self._backward_step: BackwardStep | None = None

    @property
    def nvme_bytes(self) -> int:
        """Bytes of master, gradients and (once stepped) optimizer state in swap files."""
        return sum(self.sizes) * 4 * (2 + len(self._state_names))

    # -- units -----------------------------------------------------------------------------------
    def _where(self, name: str, unit: int) -> tuple[str, int]:
        index, offset = self.unit_at[unit]
        return subgroup_key(index, name), offset * 4

    def _stage(self) -> torch.Tensor:
        """The next staging buffer, once its previous write has finished."""
        self._turn ^= 1
        pending = self._staging_write[self._turn]
        if pending is not None:
            pending.wait()
            self._staging_write[self._turn] = None
        return self._staging[self._turn]

    def _write(self, name: str, unit: int, values: torch.Tensor) -> None:
        key, offset = self._where(name, unit)
        handle = self.swapper.swap_out(key, values, offset)
        self._staging_write[self._turn] = handle
        self._unit_write[(name, unit)] = handle

    def _settle(self, name: str, unit: int) -> None:
        handle = self._unit_write.pop((name, unit), None)
        if handle is not None:
            handle.wait()

    def _read(self, name: str, unit: int, into: torch.Tensor) -> None:
        key, offset = self._where(name, unit)
        # Units share a sub-group's file: any write in flight to that file must finish first (the
        # swapper refuses to read a file while it is being written), not only this unit's.
        for pending in [k for k in self._unit_write if k[0] == name and self._where(*k)[0] == key]:
            self._settle(*pending)
        self.swapper.swap_in(key, into, offset).wait()

    def write_master(self, unit: int, values: torch.Tensor) -> None:
        """New fp32 values of ``unit``'s master shard (initial, loaded or edited); ``values`` may
        be reused once this returns."""
        n = self.shard_sizes[unit]
        if values.numel() != n:
            raise ValueError(f"unit {unit}'s master shard has {n} elements, got {values.numel()}")
        self._settle("master", unit)
        buf = self._stage()[:n]
        buf.copy_(values.reshape(-1))
        self._write("master", unit, buf)

    def read_master(self, unit: int) -> torch.Tensor:
        """A copy of ``unit``'s fp32 master shard."""
        out = aligned_empty(self.shard_sizes[unit], torch.float32)
        self._read("master", unit, out)
        return out

    # -- gradients -------------------------------------------------------------------------------
    def begin_last_backward(self, optimizer: Any, owned: Sequence[tuple[torch.Tensor, int, int, int, Any]],
                            publish: Callable[[int, torch.Tensor], None]) -> None:
        """The backward that ends a batch is about to run. With ``step_in_backward`` each
        sub-group steps as soon as :meth:`add_grad` completes it (arguments as for :meth:`step`,
        which then finishes that step); otherwise nothing happens."""
        if self.step_in_backward:
            if self._backward_step is not None:
                raise RuntimeError(
                    "zero_optimization.offload_optimizer.step_in_backward: a second backward ends the batch before "
                    "step(); the first one has already stepped the sub-groups its gradients completed, so the "
                    "gradients of this one would be lost. Call step() after each batch's last backward"
                )
            self.flush()  # the reads ahead must not meet a write of the files in flight
            self._backward_step = BackwardStep(self, optimizer, owned, publish)

    @property
    def stepped_in_backward(self) -> bool:
        """Whether this batch's step began during backward (so it cannot be skipped any more)."""
        return self._backward_step is not None

    def skip_step(self) -> None:
        """The batch is skipped (non-finite loss or gradients): impossible once sub-groups stepped
        in backward; the step begun is dropped and the job stops saying why."""
        if self.stepped_in_backward:
            self.cancel_backward_step()
            raise FloatingPointError(
                "the loss or the gradients are NaN or infinite, and with zero_optimization.offload_optimizer."
                "step_in_backward each sub-group stepped during backward as soon as its gradients were complete "
                "(those before the first non-finite one), so this step cannot be skipped; training stopped. "
                "Resume from the last checkpoint; without step_in_backward, zkit skips such steps (up to "
                "nonfinite_steps_limit in a row)"
            )

    def cancel_backward_step(self) -> None:
        """Forget the step begun in backward, once its I/O has finished (the job is stopping)."""
        early, self._backward_step = self._backward_step, None
        if early is not None:
            early.abandon()

    def share_master(self, shards: Sequence[torch.Tensor]) -> None:
        raise RuntimeError("the NVMe master store keeps its master in files; it shares no buffers")

    def add_grad_in_place(self, unit: int, grads: Sequence[torch.Tensor | None]) -> None:
        raise RuntimeError("the NVMe master store keeps its gradients in files; it takes none in place")

    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Add one micro-step's reduced gradient shard of ``unit`` (any float dtype) to what this
        batch accumulated; ``grad`` may be reused once this returns."""
        n = self.shard_sizes[unit]
        early = self._backward_step
        buf = self._stage()[:n] if early is None else early.grad_view(unit)
        copies = self.allocator.copies
        if unit in self._sq:  # an earlier micro-step of this batch wrote the unit
            # a device gradient comes to the host on the side stream while the file is read
            host, copy = copies.to(grad.reshape(-1), buf.device)
            self._read("grad", unit, buf)
            copy.wait()
            buf.add_(host)
        else:
            self._settle("grad", unit)
            copies.copy(buf, grad.reshape(-1)).wait()
        self._sq[unit] = float(torch.linalg.vector_norm(buf)) ** 2
        if early is None:
            self._write("grad", unit, buf)
        else:
            early.arrived_grad(unit)

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of this rank's accumulated gradients (``inf``/``nan`` on overflow)."""
        return sum(self._sq.values())

    def grads_finite(self) -> bool:
        """Whether the accumulated gradients are finite (their norm, noted as they were stored)."""
        return math.isfinite(self.grad_norm_sq())

    def zero_grad(self) -> None:
        """The next :meth:`add_grad` of every unit starts a new batch."""
        self.cancel_backward_step()
        self._sq.clear()

    def flush(self) -> None:
        """Wait for every write in flight (raises the first I/O error)."""
        handles, self._unit_write = list(self._unit_write.values()), {}
        self._staging_write = [None, None]
        errors = []
        for h in handles:
            try:
                h.wait()
            except Exception as exc:  # finish every request before reporting
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- step ------------------------------------------------------------------------------------
    def _plan(self, optimizer: Any, owned: Sequence[tuple[torch.Tensor, int, int, int, Any]]) -> SubGroupPlan:
        if self.plan is None:
            members: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self.sizes]
            for opt_param, unit, a, _b, _piece in owned:
                index, offset = self.unit_at[unit]
                members[index].append((opt_param, offset + a))
            self._state_names = tuple(optimizer._state_names)
            self.plan = SubGroupPlan.from_layout(members, self.sizes, self._state_names)
        return self.plan

    def subgroup_sizes(self) -> list[dict[str, int]]:
        """``{tensor name: elements}`` of every sub-group: master, gradient and the optimizer's
        state (known once :meth:`_plan` has run)."""
        return [{"master": n, "grad": n, **{name: n for name in self._state_names}} for n in self.sizes]

    def bind(self, optimizer: Any, owned: Sequence[tuple[Any, ...]]) -> None:
        """Nothing to prepare: :meth:`step` steps ``optimizer`` sub-group by sub-group."""

    def step_subgroup(self, i: int, tensors: dict[str, torch.Tensor], optimizer: Any, state: Any,
                      group_of: dict[int, dict], grad_factor: float, publish: Callable[[int, torch.Tensor], None],
                      with_grad: Container[int]) -> None:
        """Step sub-group ``i`` from ``tensors`` (its host buffers: master, gradient, state) and
        ``publish`` each of its units. ``with_grad``: the units whose gradient the buffer holds;
        the others' ranges are zeroed. Inside ``state.raw()``."""
        master, grad = tensors["master"], tensors["grad"]
        for unit in self.units_of[i]:
            if unit not in with_grad:
                _, offset = self.unit_at[unit]
                grad[offset : offset + self.shard_sizes[unit]].zero_()
        members = self.plan.members[i]
        for p, offset in members:
            p.data = master[offset : offset + p.numel()].view(p.shape)
            p.grad = grad[offset : offset + p.numel()].view(p.shape)
        try:
            state.bind(i, tensors, optimizer, group_of)
            if members:
                optimizer.fused_step(grad_factor, params=[p for p, _ in members])
            for unit in self.units_of[i]:
                _, offset = self.unit_at[unit]
                publish(unit, master[offset : offset + self.shard_sizes[unit]])
        finally:
            state.unbind(i)
            for p, _ in members:
                p.data, p.grad = placeholder(p.shape), None

    def step(self, optimizer: Any, owned: Sequence[tuple[torch.Tensor, int, int, int, Any]], grad_factor: float,
             publish: Callable[[int, torch.Tensor], None]) -> None:
        """Step ``optimizer`` (a fused CPU optimizer over the partitioner's ``owned`` pieces)
        sub-group by sub-group and ``publish(unit, master)`` every updated unit (or finish the
        step begun in backward)."""
        early, self._backward_step = self._backward_step, None
        if early is not None:
            early.finish(grad_factor)
            self.flush()
            trim()
            return
        self.flush()
        plan = self._plan(optimizer, owned)
        state = self.allocator._swapped_state(optimizer, plan)
        group_of = state.groups_by_param(optimizer)

        def step(i: int, tensors: dict[str, torch.Tensor]) -> None:
            # a unit without a gradient this batch: its range of the file holds an old one
            self.step_subgroup(i, tensors, optimizer, state, group_of, grad_factor, publish, with_grad=self._sq)

        fresh = set(range(len(plan))) - state.on_disk
        with state.raw():
            self.allocator.step_in_subgroups(self.subgroup_sizes(), step, fresh=fresh, fresh_names=plan.state_names,
                                             read_only=("grad",))
        state.on_disk.update(range(len(plan)))
        trim()  # what forward and backward freed (gathered parameters, activations)
