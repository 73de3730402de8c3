"""Stage 3: parameters partitioned too. Per-rank model states: 16Ψ/N; communication 3Ψ (the
parameters are all-gathered in forward and again in backward, gradients reduce-scattered).

Parameters are gathered in units (:mod:`zkit.zero.sharded_params`): by default each block of the
model with every parameter under it, and the root with the rest (``stage3_gather_unit``: "block",
:func:`zkit.zero.init_adopt.blocks`); or each module's own parameters ("module", DeepSpeed's). A
unit is gathered when its parameters are first used in forward, released after its module's (its
block's) forward, gathered again when backward needs a saved parameter, and released once its
gradients are reduced. Parameters (per module: units) of at most
``stage3_param_persistence_threshold`` elements stay gathered; per block, in a unit of their own. The order units are gathered in during
the first forward is recorded; afterwards each gather prefetches the next units of that order
(backward: the reverse order) up to ``stage3_prefetch_bucket_size`` elements, never holding more than
``stage3_max_live_parameters`` gathered elements, and a unit whose next use is within
``stage3_max_reuse_distance`` elements stays gathered until then (:mod:`zkit.zero.reuse`). The
gradient path is stage 2's.

Parameter offload: an allocator that places purpose ``"param"`` on the host keeps the shards there
(gathers copy them to the device); one whose ``param_shard_store(dtype)`` returns a store keeps them there
(NVMe), read ahead of the gathers along the recorded order and written back after each step. Without
one the shards are in the in-memory store (:mod:`zkit.zero.memory_param_store`): one code path.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import attrs
import torch

from zkit.core import phases
from zkit.zero.flat import Unit, persistent_units, plan_units
from zkit.zero.config import zero_config
from zkit.zero.init_adopt import stage3_groups
from zkit.zero.memory_param_store import param_shard_store
from zkit.zero.returned import returned_params
from zkit.zero.reuse import kept_after_use
from zkit.zero.sharded_params import ACTIVE, GatheredElements, ShardedUnit, SpareBuffers, ZeroParameter, unpack_saved
from zkit.zero.stage2 import Stage2


class ModuleOrderDiverged(RuntimeError):
    """Ranks ran different module sequences (data-dependent control flow) under stage 3."""


class Stage3(Stage2):
    stage = 3

    def gathers_for_16bit_save(self) -> bool:
        return zero_config(self.ctx.config).stage3_gather_16bit_weights_on_model_save

    # -- layout ----------------------------------------------------------------------------------
    def _plan_units(self, named: list[tuple[str, torch.nn.Parameter]]) -> list[Unit]:
        zc = zero_config(self.ctx.config)
        groups = stage3_groups(self.module, zc.stage3_gather_unit)
        limits = int(zc.stage3_param_persistence_threshold), int(zc.stage3_model_persistence_threshold)
        planned: list[tuple[str, list[tuple[str, torch.nn.Parameter]], bool]] = []
        if zc.stage3_gather_unit == "block":
            # Per parameter, as DeepSpeed's threshold: a block's small parameters (norms, biases)
            # stay gathered in a unit of their own, the rest is gathered and released per block.
            keep = iter(persistent_units([p.numel() for _, own in groups for _, p in own], *limits))
            for mname, own in groups:
                flags = [next(keep) for _ in own]
                for persistent in (False, True):
                    part = [named_param for named_param, f in zip(own, flags) if f is persistent]
                    if part:
                        planned.append((mname, part, persistent))
            planned.reverse()  # backward order, so reductions launch as gradients arrive
        else:
            groups.reverse()
            keep = persistent_units([sum(p.numel() for _, p in own) for _, own in groups], *limits)
            planned = [(mname, own, k) for (mname, own), k in zip(groups, keep)]
        self.unit_modules = [mname for mname, _, _ in planned]
        self._unit_persistent = [k for _, _, k in planned]
        units = []
        for i, (_, own, _) in enumerate(planned):
            (u,) = plan_units([(n, p.shape) for n, p in own], 1 << 62, self.world)
            units.append(attrs.evolve(u, index=i))
        return units

    def _build_param_buffers(self) -> None:
        zc = zero_config(self.ctx.config)
        self.sharded: list[ShardedUnit] = []
        self._gathered = GatheredElements()
        for u, params, mname, keep in zip(self.units, self.unit_params, self.unit_modules, self._unit_persistent):
            existing = getattr(params[0], "_zkit_unit", None)
            # by identity (``==`` on parameters would compare values); a unit Init made that is not
            # exactly this one is gathered and its values taken over (its parameters are all ones
            # this partitioner trains: zkit.zero.init_adopt)
            if (existing is not None and len(existing.params) == len(params)
                    and all(a is b for a, b in zip(existing.params, params)) and existing.unit.padded == u.padded):
                su = existing  # built partitioned by zkit.zero.Init
                su.unit, su.comm, su.allocator, su.module_name = u, self.comm, self.allocator, mname
                if su.shard is None:
                    pass  # in Init's shard store: this partitioner's store adopts it (_build_master)
                elif su.shard.device != self.allocator.place("param") or su.shard.dtype != self.dtype:
                    shard = self.allocator.empty(su.shard.numel(), self.dtype, "param")
                    su.shard = shard.copy_(su.shard)
                else:
                    self.allocator.track("param", su.shard.numel() * su.shard.element_size())
            else:
                su = _regrouped(u, params, self.comm, self.allocator, self.rank, mname, self.dtype)
            su.persistent = keep
            if su.persistent:
                if su.comm.world_size == 1:
                    su.release(force=True)  # gathered again as the shard itself, where it can be
                su.wait()
            else:
                su.release()
                su.gathered_count = self._gathered
            self.sharded.append(su)
        # Two of the largest released unit: a step cycles through a few unit sizes.
        released = [su.unit.padded * su.shard_dtype.itemsize for su in self.sharded if not su.persistent]
        self._spares = SpareBuffers(2 * max(released, default=0))
        weights = [p.numel() * p.element_size() for su in self.sharded if not su.persistent for p in su.params]
        self._grad_spares = SpareBuffers(2 * max(weights, default=0))
        for su in self.sharded:
            su.spares = None if su.persistent else self._spares
            su.grad_spares = None if su.persistent else self._grad_spares
        self._phase = "idle"
        self.prefetch_numel = int(zc.stage3_prefetch_bucket_size)
        self.max_live = int(zc.stage3_max_live_parameters)
        self.max_reuse = int(zc.stage3_max_reuse_distance)
        self.trace: list[int] = []
        self.trace_frozen = False
        #: per trace position: keep the unit gathered after that use; per unit in the trace: the
        #: position of its last use in forward (both set when the trace freezes)
        self._keep: list[bool] = []
        self._last_use: dict[int, int] = {}
        #: unit -> the trace position of each of its module's forward ends, in forward order
        self._hook_positions: dict[int, list[int]] = {}
        self._hook_calls: dict[int, int] = {}
        self._order: list[int] = []
        self._cursor = -1
        self._hooks_fwd = []
        owner: dict[str, list[int]] = {}
        for i, name in enumerate(self.unit_modules):
            if not self.sharded[i].persistent:
                owner.setdefault(name, []).append(i)
        for mname, module in self.module.named_modules():
            for i in owner.get(mname, ()):
                self._hooks_fwd.append(module.register_forward_hook(self._after_module_forward(i)))

    def _init_grads(self) -> None:
        super()._init_grads()
        if self.grads.in_place:  # the weights' gradients are computed fresh and added into their views
            for su in self.sharded:
                su.grad_spares = None

    @property
    def hooks_each_gradient(self) -> bool:
        # A unit released between uses is released as soon as its gradients are in; with every unit
        # kept gathered (persistent) there is nothing to release, and stage 2's reasons remain.
        return super().hooks_each_gradient or not all(su.persistent for su in self.sharded)

    def _param_shard(self, unit: Unit) -> torch.Tensor:
        return self.sharded[unit.index].local_shard()

    def _build_master(self, copy: bool = False) -> None:
        self.param_store = param_shard_store(self.allocator, self.dtype)
        # Shards that leave memory cannot be stepped in place: the fp32 master is then a copy
        # even where it could have been the parameters themselves.
        super()._build_master(copy=copy or self.param_store.shards_leave_memory)
        self.param_store.adopt([su for su in self.sharded if not su.persistent])
        for su in self.sharded:
            if su.store.shards_leave_memory and su.store is not self.param_store:
                # built by zkit.zero.Init into a store this partitioner does not use: into memory
                su.shard_to_memory(self.allocator)
        for su in self.sharded:
            # GatheredParameters edits reach the master through ``su.master.copy_`` (none to make
            # where the parameters are the master: writing the shard wrote it)
            su.master = None if self.master_is_param else _StoredMaster(self.master_store, su.unit.index)

    def _done_with_shard(self, unit: Unit) -> None:
        su = self.sharded[unit.index]
        su.store.release(su)

    # -- gathering -------------------------------------------------------------------------------
    def _live(self) -> int:
        """Elements of the released units gathered now (persistent units are not counted)."""
        return self._gathered.numel

    def _fetch(self, su: ShardedUnit) -> None:
        """Called when a released parameter is used: gather its unit, prefetch what comes next."""
        if not self.trace_frozen and self._phase == "forward":
            self.trace.append(su.unit.index)
            if self.comm.world_size > 1:
                # First forward: agree on each gather before issuing it, so ranks running
                # different modules get an error naming them rather than mismatched collectives.
                self._check_same_order(self.comm.all_gather_object(self.trace))
        with phases.phase(f"gather {self.unit_modules[su.unit.index] or 'root'!r}"):
            su.wait()
            self._prefetch_after(su.unit.index)

    def _prefetch_after(self, index: int) -> None:
        order = self._order
        if not order:
            return
        try:
            self._cursor = order.index(index, self._cursor + 1)
        except ValueError:
            return
        budget, live = self.prefetch_numel, self._live()
        # With one rank a "gather" is a copy, no collective other ranks must match: a stored shard
        # still being read is left for a later call (or its use) instead of waiting on the disk
        # here, before the compute this read-ahead is meant to run beside.
        store = self.param_store
        only_read = store.shards_leave_memory and self.comm.world_size == 1
        # One batch of gathers where the backend batches them; not with a shard store that may
        # wait for a gather in flight to free a buffer (a batch is waited for only after it).
        with contextlib.nullcontext() if store.may_wait_for_buffer else self.comm.coalesced():
            for position in range(self._cursor + 1, len(order)):  # indices: no copy of the order
                su = self.sharded[order[position]]
                # The window ahead is the prefetch size, counting units gathered already (skipped
                # free, they would let the window reach past its size).
                if budget < su.unit.padded:
                    break
                budget -= su.unit.padded
                if su.full is not None:
                    continue
                if live + su.unit.padded > self.max_live or (only_read and not su.shard_ready()):
                    break
                su.fetch()
                live += su.unit.padded
        wanted = store.lookahead
        if wanted:
            # Read the shards of the units after those ahead of their gathers (NVMe latency).
            for position in range(self._cursor + 1, len(order)):
                if wanted <= 0:
                    break
                su = self.sharded[order[position]]
                if su.full is None:
                    su.prefetch_shard()
                    wanted -= 1

    def _after_module_forward(self, index: int):
        def hook(module, args, output):
            if ACTIVE.fetch is None or self._phase != "forward" or self.sharded[index].persistent:
                return
            if any(p._zkit_unit is self.sharded[index] for p in returned_params(output)):
                return  # the caller uses it: released at the end of forward (every forward alike)
            if not self.trace_frozen:
                if index in self.trace:  # the position of this use: the unit's latest gather
                    position = len(self.trace) - 1 - self.trace[::-1].index(index)
                    self._hook_positions.setdefault(index, []).append(position)
                self.sharded[index].release()
                return
            call = self._hook_calls.get(index, 0)
            self._hook_calls[index] = call + 1
            positions = self._hook_positions.get(index, [])
            if not (call < len(positions) and self._keeps(positions[call])):
                self.sharded[index].release()

        return hook

    def _keeps(self, position: int) -> bool:
        """Keep the unit used at trace ``position`` gathered for its next use (within the reuse
        distance, and the gathered elements within ``stage3_max_live_parameters``)."""
        return self._keep[position] and self._live() <= self.max_live

    def _release_after_forward(self) -> None:
        """End of forward: keep the units backward reuses soon (the last ones first), release the rest."""
        if not self.trace_frozen:
            self._release_all()
            return
        for unit in reversed(self.trace):  # backward's order: the nearest reuse first
            su = self.sharded[unit]
            if su.full is not None and not su.persistent and not self._keeps(self._last_use[unit]):
                su.release()
        for su in self.sharded:  # gathered outside the trace (a module run only this time)
            if su.full is not None and su.unit.index not in self._last_use:
                su.release()

    def _freeze_trace(self) -> None:
        self.trace_frozen = True
        sizes = [su.unit.padded for su in self.sharded]
        self._keep = kept_after_use(self.trace, sizes, [su.persistent for su in self.sharded], self.max_reuse)
        self._last_use = {unit: position for position, unit in enumerate(self.trace)}

    def _release_all(self) -> None:
        for su in self.sharded:
            su.release()

    @contextlib.contextmanager
    def _active(self, phase: str) -> Iterator[None]:
        previous = ACTIVE.fetch
        ACTIVE.fetch, self._phase, self._cursor = self._fetch, phase, -1
        self._hook_calls = {}
        if self.trace_frozen:
            self._order = self.trace if phase == "forward" else self.trace[::-1]
        try:
            yield
        finally:
            ACTIVE.fetch = previous

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # A saved parameter is gathered again when backward unpacks it; with every unit persistent
        # none is released in between, and the hooks (an op per saved tensor) are left out.
        regather = (contextlib.nullcontext() if all(su.persistent for su in self.sharded)
                    else torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack_saved))
        with self._active("forward"), regather:
            yield
        self._release_after_forward()
        if not self.trace_frozen:
            self._check_same_order()
            self._freeze_trace()

    def _check_same_order(self, traces: list[list[int]] | None = None) -> None:
        if traces is None:
            traces = self.comm.all_gather_object(self.trace) if self.comm.world_size > 1 else [self.trace]
        for rank, other in enumerate(traces):
            if other != self.trace:
                i = next((k for k, (a, b) in enumerate(zip(self.trace, other)) if a != b), min(len(self.trace), len(other)))
                name = lambda t: self.unit_modules[t[i]] if i < len(t) else "(end of forward)"  # noqa: E731
                raise ModuleOrderDiverged(
                    f"ZeRO stage 3 needs every rank to run the same modules in the same order; at module #{i} "
                    f"rank {self.comm.rank} ran {name(self.trace)!r} but rank {rank} ran {name(other)!r}"
                )

    @contextlib.contextmanager
    def backward_context(self, boundary: bool) -> Iterator[None]:
        super().backward_context(boundary)
        with self._active("backward"):
            yield

    def after_backward(self, boundary: bool) -> None:
        super().after_backward(boundary)
        self._release_all()
        self._spares.clear()  # the optimizer step may want the memory
        self._grad_spares.clear()

    def _launch(self, unit: int):
        su = self.sharded[unit]
        # Not a gradient that another post-accumulate hook than the partitioner's saw: user code
        # may have kept it, and the next gradient of its size would overwrite it.
        grads = [p.grad for p in su.params if p.grad is not None and len(p._post_accumulate_grad_hooks or ()) <= 1
                 ] if su.grad_spares is not None else []
        handle = super()._launch(unit)  # gradients are in the bucket now
        for g in grads:  # their host memory serves the next gradient of that size
            su.grad_spares.give(g)
        su.release()
        return handle

    # -- step ------------------------------------------------------------------------------------
    def publish_unit(self, unit: int, master: torch.Tensor) -> None:
        self.sharded[unit].set_shard(master)

    def publish_target(self, unit: int) -> torch.Tensor | None:
        su = self.sharded[unit]
        return su.shard  # None where the shard left memory: it is written through its store

    def _gather_params(self) -> None:
        # The shards changed: a unit still gathered (kept for its reuse by a forward without a
        # backward) holds the old values.
        self._release_all()
        handles = []
        with self.comm.coalesced():
            for su in self.sharded:
                if su.persistent and not su.full_is_shard:
                    handles.append(self.comm.all_gather(su.full, su.device_shard(su.full.device), async_op=True))
        for h in handles:
            h.wait()

    # -- torch.compile ---------------------------------------------------------------------------
    def compile_regions(self) -> list[torch.nn.Module] | None:
        """Per block: the blocks, each gathered by a forward pre-hook before its compiled forward
        runs and released by its forward hook after (both eager, outside the compiled code), so the
        compiled code always sees gathered parameters of the same shapes and strides. Per module
        (``stage3_gather_unit: "module"``, the default with ``offload_param`` on nvme) or with no block:
        ``None`` (refused)."""
        if zero_config(self.ctx.config).stage3_gather_unit != "block":
            return None
        named = dict(self.module.named_modules())
        units: dict[str, list[ShardedUnit]] = {}
        for name, su in zip(self.unit_modules, self.sharded):
            if name:  # the root's unit is gathered on use, outside the regions
                units.setdefault(name, []).append(su)
        if not units:
            return None
        for name, block_units in units.items():
            self._hooks_fwd.append(named[name].register_forward_pre_hook(_gather_before(block_units)))
        return [named[name] for name in units]

    def close(self) -> None:
        super().close()
        for h in self._hooks_fwd:
            h.remove()
        self._hooks_fwd = []


def _gather_before(units: list[ShardedUnit]):
    def hook(module, args):
        if ACTIVE.fetch is None:
            return
        for su in units:
            if su.full is None or su.handle is not None:
                ACTIVE.fetch(su)  # the partitioner's gather: the trace, the prefetch

    return hook


def _regrouped(unit: Unit, params: list[torch.nn.Parameter], comm, allocator, rank: int, module_name: str,
               dtype: torch.dtype) -> ShardedUnit:
    """A new unit of ``params``, some of which may be in units :class:`zkit.zero.Init` made: those
    are gathered first, and each is dropped once another unit holds all of its parameters."""
    olds = list({id(p._zkit_unit): p._zkit_unit for p in params if isinstance(p, ZeroParameter)}.values())
    for old in olds:
        if old.store.shards_leave_memory:  # out of Init's shard store (NVMe): its file goes with it
            old.shard_to_memory()
        old.wait()
    # Init's dtype may differ from the training one (parameters built whole were cast by the engine)
    su = ShardedUnit.from_params(unit, params, comm, allocator, rank, module_name, dtype if olds else None)
    for old in olds:
        if all(p._zkit_unit is not old for p in old.params):
            old.drop()
    return su


class _StoredMaster:
    """``ShardedUnit.master``: an edit made under ``GatheredParameters`` is written to the master
    store (in memory: into the shard the optimizer steps)."""

    def __init__(self, store, unit: int) -> None:
        self.store, self.unit = store, unit

    def copy_(self, values: torch.Tensor) -> None:
        self.store.write_master(self.unit, values)
