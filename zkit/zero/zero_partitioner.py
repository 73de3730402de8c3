"""What the stages share: flat parameter buffers, the fp32 master shard, the optimizer over that
shard, the step and the parameter refresh. Stages 0-2 differ only in how gradients are held and
reduced (``stage0.py``, ``stage1.py``, ``stage2.py``); stage 3 (``stage3.py``) takes stage 2's
gradient path and replaces the parameter buffers with per-module shards.

Layout: trainable parameters, in reverse registration order (the order backward produces their
gradients), are packed into units of ``reduce_bucket_size`` elements (:mod:`zkit.zero.flat`). Each
parameter's ``.data`` becomes a view into its unit's flat buffer. Rank ``r`` owns shard ``r`` of every
unit: the fp32 master copy and the optimizer state of those elements. Stage 0 owns everything
(``shards_states = False``).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from zkit.core.copies import DONE, Copy
from zkit.core.partitioner import GradPiece, PartitionContext, Partitioner, Piece
from zkit.zero.model_states import model_state_bytes
from zkit.zero import full_state
from zkit.zero import offload_states as offloading
from zkit.zero.config import zero_config
from zkit.zero.flat import Unit, plan_units
from zkit.zero.init import GatheredParameters
from zkit.zero.memory_store import InMemoryMasterStore, fuses, takes_found_inf
from zkit.zero.param_refresh import ParamRefresh, without_effect

log = logging.getLogger("zkit")

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _gradient_averaging(config: Any, world: int) -> tuple[str, float, float]:
    """How gradients are averaged over ``world`` ranks: ``(op, pre, post)``, the reduction's op and
    the factors applied before and after it (DeepSpeed's ``prescale_gradients`` and
    ``gradient_predivide_factor``: in fp16 a sum of large gradients can overflow where a sum of
    pre-divided ones does not). By default the collective averages (``"avg"``)."""
    if config.prescale_gradients:
        return "sum", 1.0 / world, 1.0
    factor = config.gradient_predivide_factor
    if factor != 1.0:
        return "sum", 1.0 / factor, factor / world
    return "avg", 1.0, 1.0


class ZeroPartitioner(Partitioner):
    """Base of the data-parallel stages. Subclasses implement the gradient path:
    ``_init_grads``, ``_on_grad_ready``, ``backward_context``, ``after_backward``,
    ``reduced_grad_shards`` and ``zero_grad``."""

    shards_states = True

    def __init__(self, ctx: PartitionContext) -> None:
        super().__init__(ctx)
        zc = zero_config(ctx.config)
        self.dtype = ctx.dtype
        comm_type = getattr(ctx.config, "communication_data_type", None)
        self.comm_dtype = _COMM_DTYPES[comm_type] if comm_type else ctx.dtype
        accum = ctx.config.grad_accum_dtype  # data_types.grad_accum_dtype
        #: dtype gradients accumulate in over micro-steps (stages 2-3: the reduced shards); by
        #: default the training dtype, as DeepSpeed's: a 16-bit communication dtype rounds each
        #: reduction, not the sum of a batch's micro-steps (nor the fp32 master's .grad)
        self.accum_dtype = _COMM_DTYPES[accum] if accum else self.dtype
        if self.accum_dtype != self.dtype and self.stage < 2:
            raise ValueError(
                f"data_types.grad_accum_dtype {accum!r} differs from the {str(self.dtype).replace('torch.', '')} "
                f"gradients of ZeRO stage {self.stage}, which accumulate in the parameters' own .grad; use "
                f"stage 2 or 3 (reduced shards accumulate in {accum}) or leave grad_accum_dtype unset"
            )
        self.rank = self.comm.rank if self.shards_states else 0
        self.world = self.comm.world_size if self.shards_states else 1
        self.reduce_op, self.pre_scale, self.post_scale = _gradient_averaging(ctx.config, self.comm.world_size)

        named = list(self.named_trainable())
        if not named and getattr(self.module, "model_parallel_part", None) is None:
            # A part of a split model (a frozen pipeline stage) still runs: it passes gradients on.
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train")
        self.param_of = dict(named)
        self.units = self._plan_units(named)
        self.unit_params = [[self.param_of[s.name] for s in u.slots] for u in self.units]
        self.unit_of = {id(p): u.index for u in self.units for p in self.unit_params[u.index]}
        #: unit -> the copy of its updated master into the parameters, until its gather waits for it
        self._published: dict[int, Copy] = {}
        self._build_param_buffers()
        self._build_master()
        self.optimizer = self._build_optimizer()
        self.allocator.check_optimizer(self.optimizer, self.ctx.optimizer.name)
        self.master_store.bind(self.optimizer, self.owned)
        full_state.register(self)  # safe_get_full_fp32_param(param) and friends find this partitioner
        no_overlap = without_effect(self.stage, self.world)
        if zc.overlap_param_gather and no_overlap:
            log.warning("zero_optimization.overlap_param_gather has no effect here: %s; it applies at stages 1-2 "
                        "over several data-parallel replicas", no_overlap)
        #: background parameter all-gathers (``overlap_param_gather``), else None: gathers in step()
        self.refresh = (
            ParamRefresh(self.module, self.unit_params)
            if zc.overlap_param_gather and not no_overlap
            else None
        )
        self._init_grads()
        #: a hook per parameter, where a gradient's arrival starts work (its unit's reduction, stage
        #: 3's release of the unit); none at one replica with gradients written in place, where it
        #: would only see that each ``.grad`` is still its view: the stage sees to all of them at the
        #: end of backward, without a call into Python per parameter
        self._hooked = self.hooks_each_gradient
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_hook) for _, p in named
        ] if self._hooked else []

    # -- construction ----------------------------------------------------------------------------
    def _plan_units(self, named: list[tuple[str, torch.nn.Parameter]]) -> list[Unit]:
        bucket = max(int(zero_config(self.ctx.config).reduce_bucket_size), 1)
        return plan_units(((n, p.shape) for n, p in reversed(named)), bucket, self.world)

    def _param_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's shard of a unit's parameters (model dtype)."""
        lo, hi = unit.shard_range(self.rank)
        return self.param_bufs[unit.index][lo:hi]

    def _build_param_buffers(self) -> None:
        self.param_bufs: list[torch.Tensor] = []
        for u, params in zip(self.units, self.unit_params):
            buf = self.allocator.zeros(u.padded, self.dtype, "param")
            for slot, p in zip(u.slots, params):
                view = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                view.copy_(p.data)
                p.data = view
            self.param_bufs.append(buf)

    def _build_master(self, copy: bool = False) -> None:
        """The fp32 master of every unit's shard and the store holding it: the parameters
        themselves (fp32 on the training device, unless ``copy``) or a copy from the allocator, in
        memory (:class:`~zkit.zero.memory_store.InMemoryMasterStore`), or the allocator's own
        master store (stages 2-3 hold gradients as shards, so zkit-offload's NVMe may keep master
        and gradients elsewhere: ``self.master`` then holds zero-stride placeholders)."""
        place = self.allocator.place("master")
        store = self.allocator.master_store([u.shard for u in self.units]) if self.stage >= 2 else None
        if store is None:  # the default: in memory beside the model
            # fp32 training with the master on the training device: the parameters *are* the master.
            self.master_is_param = not copy and self.dtype == torch.float32 and place == self.ctx.device
            if self.master_is_param:
                self.master = [self._param_shard(u) for u in self.units]
            else:
                flat = self.allocator.empty(sum(u.shard for u in self.units), torch.float32, "master")
                starts = [0]
                for u in self.units:
                    starts.append(starts[-1] + u.shard)
                self.master = [flat[a:b] for a, b in zip(starts, starts[1:])]
            store = InMemoryMasterStore(self, self.master, self.master_is_param)
        elif store.shares_buffers and not copy and self.dtype == torch.float32 and place == self.ctx.device:
            # a store in the training device's memory steps the fp32 parameters themselves, as
            # the in-memory store does: nothing to copy in or publish
            self.master_is_param = True
            self.master = [self._param_shard(u) for u in self.units]
            store.share_master(self.master)
        else:
            self.master_is_param = False
            placeholder = torch.empty((), dtype=torch.float32, device=place)
            self.master = [placeholder.expand(u.shard) for u in self.units]
        self.master_store = store
        if self.master_is_param:
            return  # the master is the parameters' shards: nothing to copy
        for u in self.units:
            store.write_master(u.index, self._param_shard(u))
            self._done_with_shard(u)

    def _done_with_shard(self, unit: Unit) -> None:
        """Called after :meth:`_param_shard` was read (stage 3 returns a stored shard's buffer)."""

    def _build_optimizer(self) -> torch.optim.Optimizer:
        rec = self.ctx.optimizer
        group_of = {}
        for gi, group in enumerate(self.ctx.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.ctx.param_groups
        ]
        # Model parameter numbering shared by all ranks (named_trainable order), per group in step
        # with the optimizer's parameters: what a non-elementwise optimizer sums its norms by.
        model_index = {name: i for i, name in enumerate(self.param_of)}
        group_index: list[list[int]] = [[] for _ in groups]
        #: (optimizer param, unit, start in shard, end in shard, piece) for every owned piece.
        self.owned: list[tuple[torch.nn.Parameter, int, int, int, Any]] = []
        for u in self.units:
            for piece in u.pieces(self.rank):
                a = piece.shard_offset
                opt_param = torch.nn.Parameter(self.master[u.index][a : a + piece.numel], requires_grad=True)
                gi = group_of.get(id(self.param_of[piece.slot.name]), 0)
                groups[gi]["params"].append(opt_param)
                group_index[gi].append(model_index[piece.slot.name])
                self.owned.append((opt_param, u.index, a, a + piece.numel, piece))
        if not self.owned:
            # A rank owning nothing still needs an optimizer (schedules and checkpoints see it).
            # Its empty placeholder never has a gradient; any index serves.
            groups[0]["params"].append(torch.nn.Parameter(torch.zeros(0, device=self.master_device)))
            group_index[0].append(0)
        optimizer = rec.factory(groups, **self.ctx.optimizer_params)
        if self.shards_states and self.world > 1 and not rec.elementwise:
            if not callable(getattr(optimizer, "set_shard_norms", None)):
                raise ValueError(
                    f"optimizer {rec.name!r} is not elementwise (it needs whole-parameter norms), so it "
                    f"cannot step on ZeRO stage {self.stage} shards; use stage 0 or an elementwise optimizer"
                )
            device = self.ctx.device

            def all_reduce(t: torch.Tensor) -> None:
                # Through the training device: the master (and the optimizer) may live on the host.
                on_device = t.to(device)
                self.comm.all_reduce(on_device, "sum")
                if on_device is not t:
                    t.copy_(on_device)

            optimizer.set_shard_norms([i for index in group_index for i in index], len(model_index), all_reduce)
        return optimizer

    def unit_names(self) -> list[str]:
        """A readable name per unit for diagnostics: its first parameter (and how many more)."""
        return [
            repr(u.slots[0].name) + (f" +{len(u.slots) - 1} more" if len(u.slots) > 1 else "") for u in self.units
        ]

    @property
    def master_device(self) -> torch.device:
        return self.master[0].device if self.master else self.ctx.device

    def _grad_hook(self, param: torch.Tensor) -> None:
        if id(param) not in self.unit_of:
            # torch hands a post-accumulate hook's return value to the next hook as the parameter
            raise RuntimeError(
                f"ZeRO stage {self.stage}: its gradient hook was called with a {type(param).__name__} of shape "
                f"{tuple(param.shape)} that is not one of the model's parameters. A post-accumulate-grad hook "
                f"registered before zkit.initialize returned a value, and torch passes that value on to the next "
                f"hook in place of the parameter; make that hook return None"
            )
        self._on_grad_ready(param)

    # -- stage-specific gradient path ------------------------------------------------------------
    def _init_grads(self) -> None:
        raise NotImplementedError

    @property
    def hooks_each_gradient(self) -> bool:
        """Whether :meth:`_on_grad_ready` runs for each gradient as backward makes it (after
        :meth:`_init_grads`); without, the stage takes the gradients in at :meth:`after_backward`."""
        return True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def reduced_grad_shards(self) -> list[torch.Tensor]:
        """Per unit, the reduced gradient of this rank's whole shard (model, communication or
        accumulation dtype; fp32 in host memory beside an offloaded master), padding included (it
        is zero), valid between the last backward of a batch and the step: what the in-memory
        master store steps, norms and checks."""
        raise NotImplementedError

    @property
    def keeps_grad_buffers(self) -> bool:
        """Whether :meth:`reduced_grad_shards` gives the same tensors every step (see
        :class:`zkit.zero.memory_store.MasterOwner`); stages 2-3 make their shards per batch."""
        return False

    @property
    def shows_reduced_grads(self) -> bool:
        """Whether :meth:`reduced_grads` can show the gradients: not where the master store takes
        them (:class:`zkit.core.partitioner.ReducedGradients`)."""
        return not self.master_store.takes_grads

    def reduced_grads(self) -> list[GradPiece]:
        """This rank's reduced gradient pieces (:class:`zkit.core.partitioner.ReducedGradients`)."""
        shards = self.reduced_grad_shards()
        return [
            GradPiece(name=piece.slot.name, start=piece.param_start, end=piece.param_end, grad=shards[u][a:b])
            for _, u, a, b, piece in self.owned
        ]

    def unit_key(self, unit: int) -> str:
        """The name of a gradient unit's reduction, the same every step and after a restart (a
        communicator keeping per-tensor state keys it by this, not by the scratch bucket)."""
        return f"grad/{unit}"

    # -- step ------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        sq += self.master_store.grad_norm_sq()
        if self.shards_states and self.world > 1:
            self.comm.all_reduce(sq, "sum")
        return sq.sqrt()

    def grads_finite(self) -> torch.Tensor:
        finite = self.master_store.grads_finite()  # a host store may answer with a bool
        return finite if torch.is_tensor(finite) else torch.tensor(bool(finite), device="cpu")

    def step(self, grad_factor: float | torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
        self.wait_for_parameters()  # the in-place all-gathers read the shard the step writes
        self.allocator.copies.synchronize()  # copies in flight may still read host buffers the step writes
        store = self.master_store
        if isinstance(store, InMemoryMasterStore):
            # skips on the device where the optimizer can; unchanged masters publish unchanged
            # parameters, so the gathers below need no verdict either
            if not store.step(self.optimizer, self.owned, grad_factor, self.publish_from_buffer, found_inf):
                return
        else:  # a store kept elsewhere steps on the host: it needs the verdict and factor there
            if found_inf is not None and found_inf.item():
                self.skip_step()
                return
            store.step(self.optimizer, self.owned, float(grad_factor), self.publish_from_buffer)
        self._gather_params()

    def skip_step(self) -> None:
        self.master_store.skip_step()  # raises when the store applied part of the step already
        super().skip_step()

    @property
    def copy_out(self) -> bool:
        """Whether the optimizer's step writes the 16-bit parameters itself (the in-memory
        store's fused copy-out, :meth:`zkit.zero.memory_store.InMemoryMasterStore.bind`)."""
        return bool(getattr(self.master_store, "copy_out", False))

    def step_kernel(self) -> str:
        """What the optimizer step runs, for the step log."""
        name = type(self.optimizer).__name__
        if fuses(self.optimizer):
            return f"{name}: {self.optimizer.last_kernel}"
        clips = self.ctx.config.gradient_clipping > 0
        if takes_found_inf(self.optimizer) and self.allocator.optimizer_stepper() is None:
            how = "torch's fused kernel, skipping on the device's non-finite verdict" + (
                ", the gradients scaled by the clip factor in it" if clips else "")
        else:
            how = "the gradients scaled by the clip factor, then the step" if clips else "the step"
        copied = "" if self.master_is_param or self.copy_out else ", then the master copied into the parameters"
        return f"{name}.step ({how}{copied})"

    def publish_target(self, unit: int) -> torch.Tensor | None:
        """The buffer :meth:`publish_unit` writes a unit's updated master into (this rank's shard of
        its parameters); ``None`` where that shard is not in memory (a store keeps it)."""
        lo, hi = self.units[unit].shard_range(self.rank)
        return self.param_bufs[unit][lo:hi]

    def publish_params(self) -> None:
        """Copy the updated master shard into the model's parameters and all-gather every unit
        (in the background with ``overlap_param_gather``; see :mod:`zkit.zero.param_refresh`)."""
        if not self.master_is_param:
            for u in self.units:
                self.publish_unit(u.index, self._master_of(u.index))
        self._gather_params()

    def _master_of(self, unit: int) -> torch.Tensor:
        """The fp32 master of ``unit``'s shard (a copy read back from a store kept elsewhere)."""
        return self.master_store.read_master(unit)

    def publish_unit(self, unit: int, master: torch.Tensor) -> None:
        """Copy one unit's updated master into this rank's shard of the parameters (on the side
        stream from a host master; the unit's gather waits for it), without waiting: ``master``
        must stay unchanged until the parameters are next gathered (the in-memory store's shards
        do)."""
        lo, hi = self.units[unit].shard_range(self.rank)
        self._published[unit] = self.allocator.copies.copy(self.param_bufs[unit][lo:hi], master)

    def publish_from_buffer(self, unit: int, master: torch.Tensor) -> None:
        """:meth:`publish_unit` from a buffer the master store reuses once this returns (what a
        master store's ``step`` calls for every updated unit)."""
        self.publish_unit(unit, master)
        self.allocator.copies.synchronize()

    def _wait_published(self) -> None:
        """Order the parameters' next use after every publish copy still pending."""
        for copy in self._published.values():
            copy.wait()
        self._published.clear()

    def _gather_params(self) -> None:
        if not (self.shards_states and self.world > 1):
            self._wait_published()
            return
        if self.refresh is not None:  # one by one: the next forward waits for each unit's own gather
            self.refresh.start(self._launch_gathers)
            return
        with self.comm.coalesced():  # all waited together: one batch where the backend batches
            handles = self._launch_gathers()
        for h in handles.values():
            h.wait()

    def _launch_gathers(self) -> dict[int, Any]:
        """Start every unit's all-gather, first layers first (units are laid out in backward
        order); unit -> handle."""
        handles = {}
        for unit in reversed(range(len(self.units))):
            u, buf = self.units[unit], self.param_bufs[unit]
            lo, hi = u.shard_range(self.rank)
            self._published.pop(unit, DONE).wait()  # the gather sends the published shard
            # in place: the input is this rank's own chunk of the output (gloo and NCCL allow it)
            handles[unit] = self.comm.all_gather(buf, buf[lo:hi], async_op=True)
        return handles

    def wait_for_parameters(self) -> None:
        if self.refresh is not None:
            self.refresh.wait()

    def forward_context(self):
        return self.refresh.forward() if self.refresh is not None else contextlib.nullcontext()

    def after_load(self, pieces: list[Piece]) -> None:
        self._store_loaded_masters(pieces)
        self.publish_params()
        self.wait_for_parameters()

    def _store_loaded_masters(self, pieces: list[Piece]) -> None:
        """Write the masters loaded into ``pieces`` (some or all of those :meth:`pieces` gave)
        back to the store (the in-memory store's own shards: each copy finds its own memory)."""
        where = {id(opt_param): (unit, a, b) for opt_param, unit, a, b, _ in self.owned}
        loaded: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for piece in pieces:
            if id(piece.opt_param) not in where:
                raise ValueError(f"after_load: piece {piece.name!r} [{piece.start}:{piece.end}] is not one this rank owns")
            unit, a, b = where[id(piece.opt_param)]
            loaded.setdefault(unit, []).append((a, b, piece.master))
        for unit, parts in loaded.items():
            master = self.master_store.read_master(unit)
            for a, b, view in parts:
                master[a:b].copy_(view.reshape(-1))
            self.master_store.write_master(unit, master)

    # -- state -----------------------------------------------------------------------------------
    def pieces(self) -> list[Piece]:
        """This rank's pieces. A master the store keeps elsewhere is read into copies here (the
        in-memory store gives its shards themselves): saving reads them, loading writes into them
        and :meth:`after_load` stores them back (the partitioner keeps no reference to them: after a
        save they are freed with the pieces)."""
        self.allocator.copies.synchronize()  # a load writes the masters that copies in flight read
        read = {u.index: self.master_store.read_master(u.index) for u in self.units}
        masters = [read[u][a:b].view(p.shape) for p, u, a, b, _ in self.owned]
        return [
            Piece(
                name=piece.slot.name,
                shape=piece.slot.shape,
                start=piece.param_start,
                end=piece.param_end,
                master=master,
                opt_param=opt_param,
            )
            for master, (opt_param, _, _, _, piece) in zip(masters, self.owned)
        ]

    def writes_checkpoint(self) -> bool:
        return self.shards_states or self.comm.rank == 0

    def gathered(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
        return GatheredParameters(params)

    def host_state_bytes(self) -> int:
        """By ``zkit estimate``'s formula, with the gathered parameters and buckets of a step."""
        z = zero_config(self.ctx.config)
        shapes = [(n, tuple(p.shape)) for n, p in self.module.named_parameters() if p.requires_grad]
        if not shapes:
            return 0
        dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.ctx.dtype, "fp32")
        states = model_state_bytes(
            shapes, stage=z.stage, world_size=self.comm.world_size, dtype=dtype, accelerator=False,
            reduce_bucket_size=z.reduce_bucket_size, overlap_comm=z.overlap_comm,
            stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=z.stage3_param_persistence_threshold,
            stage3_max_reuse_distance=z.stage3_max_reuse_distance, stage3_gather_unit=z.stage3_gather_unit,
        )
        return states.device_total + states.host_total

    def offload_states(self, include: Any, device: Any, pin_memory: bool, non_blocking: bool) -> None:
        offloading.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool) -> None:
        offloading.reload_states(self, non_blocking)

    def offloaded_states(self) -> list[str]:
        return offloading.offloaded_kinds(self)

    def close(self) -> None:
        if self.refresh is not None:
            self.refresh.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
