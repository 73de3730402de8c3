"""The training engine: DeepSpeed's API over a stack of plugins.

    engine, optimizer, dataloader, lr_scheduler = zkit.initialize(model=model, config=cfg)
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The engine itself orders things in time: micro-steps and accumulation boundaries, the step and
sample counters, and which hook runs when; around each backward it scales the loss
(:mod:`zkit.core.microstep`). The optimizer step (the gradient norm, the overflow check, the
loss-scale update, clipping, the skipped-step policy) is the answer to ``zkit_optimizer_step``
(built in: :mod:`zkit.train_loop.optimizer_step`), handed a
:class:`~zkit.core.step_context.StepContext` rather than the engine; step lines and metrics are the
telemetry plugin's (``zkit_after_step``). What is held where and how it is communicated belongs to
the plugins it was built from (partitioner, communicator, optimizer, scheduler, allocator).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import attrs
import torch

from zkit.core import distributed, phases
from zkit.core.assembly import Assembly
from zkit.core.communicator import Communicator
from zkit.core.compile import compile_in_place, compile_module, is_compiled, unwrap_compiled
from zkit.core.config import ZkitConfig, load_config
from zkit.core.microstep import MicroStep
from zkit.core.partitioner import PartitionContext, Partitioner, built_partitioned
from zkit.core.plugin_manager import ZkitPluginManager, builtin_implementers, get_plugin_manager
from zkit.core.precision import LossScaler, cast_model
from zkit.core.records import OptimizerRecord
from zkit.core.stack import Stack, configure
from zkit.core.stash import Stash
from zkit.core.step_context import StepContext
from zkit.core.step_outcome import StepOutcomes
from zkit.core.memory import memory_snapshot
from zkit.core.metrics import NoMonitor

log = logging.getLogger("zkit")


def initialize(
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    config: Any = None,
    config_params: Any = None,
    stack: Stack | None = None,
    collate_fn: Any = None,
    args: Any = None,
    dist_init_required: bool | None = None,
    mpu: Any = None,
    engine_class: type["Engine"] | None = None,
) -> tuple["Engine", torch.optim.Optimizer, Any, Any]:
    """Build an :class:`Engine`; returns ``(engine, optimizer, dataloader, lr_scheduler)`` like
    ``deepspeed.initialize``. ``config`` is a DeepSpeed-style dict or JSON path (``config_params``
    and ``args.deepspeed_config`` are accepted too); ``stack`` chooses plugins in Python;
    ``optimizer`` may be a torch optimizer (its class and defaults are rebuilt over the shards) or a
    callable ``param_groups -> optimizer``. ``engine_class`` builds a subclass of :class:`Engine`
    instead (the ``deepspeed`` drop-in's ``DeepSpeedEngine`` adds DeepSpeed's remaining accessors);
    it takes :class:`Engine`'s constructor arguments."""
    if engine_class is not None and not (isinstance(engine_class, type) and issubclass(engine_class, Engine)):
        raise TypeError(f"zkit.initialize(engine_class={engine_class!r}): give a subclass of zkit.core.engine.Engine")
    if model is None:
        raise ValueError("zkit.initialize needs model=")
    if mpu is not None:
        raise ValueError("mpu= is not supported: tensor and pipeline groups come with the model (a pipeline plugin's "
                         "topology gives each stage its data_parallel_group)")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("zkit.initialize needs config= (a dict or a path to a DeepSpeed-style JSON file)")
    engine = (engine_class or Engine)(
        model,
        config,
        stack=stack or Stack(),
        model_parameters=model_parameters,
        client_optimizer=optimizer,
        client_lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    optimizer_out = None if engine.inference_only else engine.optimizer
    return engine, optimizer_out, engine.training_dataloader, engine.lr_scheduler


class Engine(torch.nn.Module):
    """Wraps the model; see :func:`initialize`."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: Any,
        *,
        stack: Stack,
        model_parameters: Iterable[Any] | None = None,
        client_optimizer: Any = None,
        client_lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        super().__init__()
        # torch.compile(model): train the model itself, compiled in place the same way (zkit.core.compile)
        model, compiled_with = unwrap_compiled(model)
        distributed.ensure_initialized()
        self.pm: ZkitPluginManager = get_plugin_manager(extra_plugins=stack.plugins)
        #: plugins' per-engine state (``engine.stash[key]``, see :mod:`zkit.core.stash`)
        self.stash = Stash()
        #: what runs around every backward, here and in schedules that drive their own micro-batches
        self.micro_step_protocol = MicroStep(self)
        # A model that brings its own data-parallel group (a pipeline stage's replicas) trains over
        # that group: batch arithmetic and the partitioner's collectives use it, not the world.
        dp_group = getattr(model, "data_parallel_group", None)
        world = torch.distributed.get_world_size(dp_group)
        self.config: ZkitConfig = load_config(config, world_size=world, sections=self.pm.config_sections(),
                                              providers=self.pm.config_providers())
        if self.config.seed is not None:
            _seed_everything(self.config.seed)
        self.device = distributed.default_device()
        # plugins choose per device (zkit-cuda-numba's kernel answers "FusedAdam" on cuda only); with
        # optimizer= they choose without the config's optimizer section, which is ignored (below)
        chosen_from = attrs.evolve(self.config, optimizer=None) if client_optimizer is not None else self.config
        self.stack, self.records = configure(self.pm, stack, chosen_from, self.device)

        self.dtype = self.config.dtype
        # plugins fit what they put into the model before initialize (zero.Init's units) to this stack
        self.pm.hook.zkit_prepare_model(model=model, stage=self.records["partitioner"].stage, world_size=world)
        self.module = cast_model(model, self.dtype, self.device)
        if compiled_with is not None:
            compile_in_place(self.module, self.records["partitioner"], compiled_with)
        #: where communicators, the allocator and stores come from (plugins ask it too)
        self.assembly = Assembly(self.pm, self.config, self.stack, self.records, self.device)
        self.comm = self.assembly.gradient_communicator(dp_group)
        #: the whole world (a pipeline's point-to-point transfers); the same object without a group
        self.world_comm = self.comm if dp_group is None else self.assembly.communicator(None)
        self.allocator = self.assembly.allocator
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # Ranks that built the model from different seeds must still train one model (as DDP and
        # DeepSpeed do): rank 0 of the data-parallel group's values win.
        src = torch.distributed.get_process_group_ranks(dp_group)[0] if dp_group is not None else 0
        setup_comm = self.assembly.communicator(dp_group)  # a third party's too, when chosen
        broadcast_module(self.module, setup_comm, src)
        setup_comm.reset_stats()  # the first traffic of a new assembly: comm_stats() counts training's
        #: the process group of the ranks that split each sequence with this one
        #: (``sequence_parallel_size`` > 1, set up by a plugin answering ``zkit_sequence_parallel``), else None
        self.sequence_parallel_group = self._sequence_parallel()

        #: built without an optimizer: forward and eval only (backward/step say so)
        self.inference_only = False
        opt_record, opt_params = self._optimizer_choice(client_optimizer)
        if opt_record.needs_communicator:
            opt_params = {**opt_params, "comm": self.comm}
        self.partitioner: Partitioner = self.records["partitioner"].factory(
            PartitionContext(
                module=self.module,
                param_groups=_param_groups(self.module, model_parameters, client_optimizer),
                config=self.config,
                comm=self.comm,
                allocator=self.allocator,
                optimizer=opt_record,
                optimizer_params=opt_params,
                device=self.device,
                dtype=self.dtype,
            )
        )
        self.optimizer = self.partitioner.optimizer
        self.lr_scheduler = self._lr_scheduler(client_lr_scheduler)
        self.loss_scaler = LossScaler.from_config(self.config.fp16)
        self.training_dataloader = self._dataloader(training_data, collate_fn) if training_data is not None else None

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        #: applied or skipped, the gradient norm, skipped steps: read lazily (zkit.core.step_outcome)
        self._outcomes = StepOutcomes()
        #: backward passes whose gradients wait for the optimizer step (a checkpoint cannot hold them)
        self.pending_micro_steps = 0
        self._no_sync = False
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary()
        #: the detached losses of this global batch's micro-steps (the step's non-finite check reads them)
        self.batch_losses: list[torch.Tensor] = []
        self.tokens_per_sample: int | None = None  # set it to log tokens/s
        #: compute the global gradient norm every step even without fp16 or clipping (for logging)
        self.track_grad_norm = False
        self._closed = False
        #: metric writers (``engine.monitor.write_events``), from the ``zkit_make_monitor`` hook
        self.monitor = self.pm.hook.zkit_make_monitor(config=self.config, rank=self.rank) or NoMonitor()
        # the built-in activations plugin applies the activation_checkpointing section here, first
        self.pm.hook.zkit_engine_setup(engine=self)
        if self.config.dump_state and self.rank == 0:
            self._dump_state()

    def _sequence_parallel(self) -> Any:
        size = self.config.sequence_parallel_size
        if size == 1:
            return None
        group = self.pm.hook.zkit_sequence_parallel(module=self.module, assembly=self.assembly, stash=self.stash,
                                                    config=self.config, device=self.device, size=size)
        if group is None:
            provider = self.pm.provider("hook", "zkit_sequence_parallel")
            install = f"{provider.install()}, or" if provider is not None else "install a plugin that does, or"
            raise ValueError(
                f"config key 'sequence_parallel_size' is {size}, but no plugin provides sequence parallelism (none "
                f"answers the hook zkit_sequence_parallel): {install} set it to 1"
            )
        return group

    def _dump_state(self) -> None:
        """``dump_state``: what this engine was built from, once, on rank 0."""
        import json

        chosen = {family: (rec.name, rec.dist) if rec is not None else None for family, rec in self.records.items()}
        log.info("engine state: world size %d, device %s, dtype %s, stage %d", self.world_size, self.device,
                 self.dtype, self.partitioner.stage)
        log.info("engine state: plugins %s", chosen)
        log.info("engine state: config %s", json.dumps(self.config.to_dict(), default=str, sort_keys=True))

    # -- construction helpers ----------------------------------------------------------------------
    def _optimizer_choice(self, client: Any) -> tuple[OptimizerRecord, dict[str, Any]]:
        record = self.records["optimizer"]
        if client is not None and (record is not None or self.config.optimizer is not None):
            # DeepSpeed steps the client's optimizer and ignores the config's section: so does zkit,
            # and says so (a section that does nothing must not pass silently)
            section = self.config.optimizer.type if self.config.optimizer is not None else record.name
            log.warning("optimizer= (%s) was given and the config names optimizer %r: the client's optimizer is "
                        "trained and the config's optimizer section is ignored, as in DeepSpeed",
                        type(client).__name__, section)
            record = None
        if record is not None:
            params = dict(self.config.optimizer.params) if self.config.optimizer is not None else {}
            if self.stack.optimizer is not None and self.config.optimizer is None:
                params = {}
            return record, params
        # the client's optimizer= becomes the record; none anywhere is an engine for inference or
        # evaluation, as DeepSpeed allows
        self.inference_only = client is None
        record = self.pm.hook.zkit_client_optimizer(optimizer=client)
        return _answered(record, f"zkit.initialize(optimizer={_given(client)})", "zkit_client_optimizer"), {}

    def _lr_scheduler(self, client: Any) -> Any:
        record = self.records["scheduler"]
        if record is not None:
            if record.kind != "lr":
                raise ValueError(f"scheduler {record.name!r} is a {record.kind} schedule, not an LR schedule")
            params = dict(self.config.scheduler.params) if self.config.scheduler is not None else {}
            return record.factory(self.optimizer, **params)
        if client is None:
            return None
        scheduler = self.pm.hook.zkit_client_lr_scheduler(lr_scheduler=client, optimizer=self.optimizer)
        return _answered(scheduler, f"zkit.initialize(lr_scheduler={_given(client)})", "zkit_client_lr_scheduler")

    def _dataloader(self, data: Any, collate_fn: Any) -> torch.utils.data.DataLoader:
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=self.config.seed or 0
        )
        loader = torch.utils.data.DataLoader(
            data,
            batch_size=self.config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=self.config.dataloader_drop_last,
        )
        if len(loader) == 0:  # the sampler needs len(data): known here, and train_batch() would wait forever
            raise ValueError(_no_batches(len(data), self.config.train_micro_batch_size_per_gpu, self.world_size))
        return loader

    # -- accessors (DeepSpeed's names; those only DeepSpeed code reads are on the drop-in's
    # deepspeed.DeepSpeedEngine, a subclass built through initialize(engine_class=...)) ---------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends a global batch: from the micro-step counter, unless a
        training loop that counts micro-batches itself said so (:meth:`set_gradient_accumulation_boundary`)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the coming backward and ``step()`` end a global batch (Accelerate and
        Hugging Face's Trainer count micro-batches themselves and call ``step()`` only at their
        boundary); once called, it decides instead of the engine's micro-step counter."""
        self._boundary_override = bool(is_boundary)

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage of the partitioner record in use (0 for a partitioner of no stage)."""
        return int(self.records["partitioner"].stage)

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last step's unscaled global gradient norm (None when it computed none); read from
        the device only now."""
        return self._outcomes.grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last step was applied; read from the device only now."""
        return self._outcomes.applied

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient (fp16 overflows included); steps that
        decided on the device are read from it only now."""
        return self._outcomes.skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._outcomes.skipped = value

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def train_state_dict(self) -> dict[str, Any]:
        """Where training stands: the micro-step, step, sample and skipped-step counters and the
        loss scaler. Checkpoints store it; ``state_dict()`` stays the module's (as DeepSpeed's)."""
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict(),
        }

    def load_train_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`train_state_dict`."""
        missing = sorted({"micro_steps", "global_steps", "global_samples", "skipped_steps", "loss_scaler"} - set(state))
        if missing:
            raise KeyError(f"load_train_state_dict: the state has no {', '.join(missing)}")
        self.micro_steps = int(state["micro_steps"])
        self.global_steps = int(state["global_steps"])
        self.global_samples = int(state["global_samples"])
        self.skipped_steps = int(state["skipped_steps"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the module's forward with ``torch.compile`` (DeepSpeed's call; a second call does
        nothing). The engine's hooks, reductions and optimizer step stay eager; see :mod:`zkit.core.compile`."""
        self._require_open("compile")
        if not self.is_compiled:
            compile_module(self.module, self.records["partitioner"], backend, compile_kwargs, schedule,
                           compiled_autograd_enabled, self.partitioner.compile_regions())

    @property
    def is_compiled(self) -> bool:
        """Whether the module's forward runs under ``torch.compile``."""
        return is_compiled(self.module)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Collective kind -> ``{"calls", "bytes"}`` sent by this rank since start (or reset)."""
        return self.comm.stats()

    def memory(self) -> dict[str, Any]:
        """This rank's memory: model-state bytes by purpose, and the process's RSS."""
        return memory_snapshot(self._memory_stats())

    def _memory_stats(self) -> dict[str, dict[str, int]]:
        """The allocator's per-purpose bytes plus the optimizer state (torch allocates that lazily,
        outside the allocator)."""
        stats = dict(self.allocator.stats())
        state_bytes = sum(
            t.numel() * t.element_size()
            for st in self.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        stats["optim_state"] = {"live": state_bytes, "peak": max(state_bytes, stats.get("optim_state", {}).get("peak", 0))}
        return stats

    # -- training ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _to_half((args, kwargs))
        self._require_on_device("forward")
        # the probe inside the partitioner's context: its saved-tensor hooks pass on to stage 3's
        with self._phase("forward"), phases.phase("forward"), self.partitioner.forward_context(), \
                self._model_pass("forward"):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for the backward passes inside (accumulate locally)."""
        self._require_open("no_sync")
        if not self.partitioner.no_sync_allowed():
            raise RuntimeError(
                f"no_sync() is not possible with ZeRO stage {self.partitioner.stage}: it reduces gradients at "
                f"every micro-step; use gradient_accumulation_steps instead"
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagate ``loss`` (scaled for fp16, divided by the accumulation steps)."""
        self._require_open("backward")
        if self.inference_only:
            raise RuntimeError(NO_OPTIMIZER)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}")
        self.batch_losses.append(loss.detach().float())
        self.pending_micro_steps += 1
        boundary = self.is_gradient_accumulation_boundary() and not self._no_sync
        micro = self.micro_step_protocol  # the hooks and the partitioner's reduction around it
        with self._phase("backward"), phases.phase("backward"):
            with micro.backward(loss, boundary), self._model_pass("backward"):
                micro.scale(loss, divide_by_accumulation=scale_wrt_gas).backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """End a micro-step; at an accumulation boundary, run the optimizer step."""
        self._require_on_device("step")
        if self.inference_only:
            raise RuntimeError(NO_OPTIMIZER)
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.config.world_size
        if not boundary:
            return
        self.run_optimizer_step()
        self.global_steps += 1
        if self.global_steps == 1 and self.rank == 0:
            log.info("optimizer step kernel: %s", self.partitioner.step_kernel())
        self._after_step()

    def run_optimizer_step(self) -> bool | torch.Tensor:
        """Run the optimizer step now, through the ``zkit_optimizer_step`` hook; returns whether it
        was applied (False when fp16 overflow skipped it; a 0-dim bool tensor when the step
        decided on the device, see :meth:`was_step_applied`). ``step()`` calls it at an accumulation
        boundary; a ``zkit_train_batch`` implementation that drives its own micro-batches (a
        pipeline schedule) calls it where its schedule steps."""
        with self._phase("step"), phases.phase("optimizer.step"):
            self._outcomes.applied = self.pm.hook.zkit_optimizer_step(step=self._step_context())
        self.pending_micro_steps = 0  # the batch's gradients are spent (or dropped, if skipped)
        return self._outcomes.applied_unread

    def finish_global_batch(self, loss: torch.Tensor) -> None:
        """Account one global batch run by a ``zkit_train_batch`` implementation outside
        ``forward``/``backward``/``step``: advance the micro-step, sample and step counters as
        ``gradient_accumulation_steps`` calls of ``step()`` would, and log ``loss`` as the batch's
        loss in the step line and monitors."""
        m = self.gradient_accumulation_steps()
        self.micro_steps += m
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.config.world_size * m
        self.global_steps += 1
        self.batch_losses = [loss.detach().float().reshape(())]
        self._after_step()

    def wait_for_parameters(self) -> None:
        """Block until the parameters hold their values after the last step. Only needed with
        ``zero_optimization.overlap_param_gather``, by code that reads ``module.parameters()``
        between ``step()`` and the next forward (an EMA copy, a weight statistic); forward,
        ``state_dict()``, checkpoints and ``GatheredParameters`` wait on their own."""
        self.partitioner.wait_for_parameters()

    def _step_context(self) -> StepContext:
        """What the ``zkit_optimizer_step`` answer reads and may change, for the coming step."""
        return StepContext(
            number=self.global_steps + 1, config=self.config, partitioner=self.partitioner, comm=self.comm,
            loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler, stash=self.stash,
            batch_losses=tuple(self.batch_losses), needs_grad_norm=self.needs_grad_norm(), device=self.device,
            rank=self.rank, world_size=self.world_size,
            grad_norm_hook=lambda step: self.pm.hook.zkit_grad_norm(step=step), record_outcome=self._outcomes.record,
        )

    def needs_grad_norm(self) -> bool:
        """Whether a step computes the global gradient norm: for fp16's overflow check, for
        clipping, or because the user asked (``track_grad_norm``)."""
        return self.loss_scaler.enabled or self.config.gradient_clipping > 0 or self.track_grad_norm

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one global batch (``gradient_accumulation_steps`` micro-batches) from ``data_iter``
        (default: the engine's own dataloader, cycled)."""
        self._require_open("train_batch")
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() needs a data iterator or training_data= at initialize")
            data_iter = self._cycle()
        return self.pm.hook.zkit_train_batch(engine=self, data_iter=data_iter)

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Evaluate one global batch (``gradient_accumulation_steps`` micro-batches) from
        ``data_iter`` without gradients; returns the mean loss (a pipeline: on every stage)."""
        self._require_open("eval_batch")
        return self.pm.hook.zkit_eval_batch(engine=self, data_iter=iter(data_iter))

    def _cycle(self) -> Iterator[Any]:
        if not hasattr(self, "_data_cycle"):
            def forever():
                epoch = 0
                while True:
                    self.training_dataloader.sampler.set_epoch(epoch)
                    batches = 0
                    for batch in self.training_dataloader:
                        batches += 1
                        yield batch
                    if not batches:  # a dataset whose len() said otherwise: no epoch would end
                        raise ValueError(_no_batches(0, self.train_micro_batch_size_per_gpu(), self.world_size))
                    epoch += 1

            self._data_cycle = forever()
        return self._data_cycle

    # -- what plugins wrap around the work --------------------------------------------------------
    def _phase(self, phase: str) -> contextlib.AbstractContextManager:
        return _enter_all(self.pm.hook.zkit_phase(engine=self, phase=phase))

    def _model_pass(self, direction: str) -> contextlib.AbstractContextManager:
        return _enter_all(self.pm.hook.zkit_model_pass(engine=self, direction=direction))

    def _after_step(self) -> None:
        losses, self.batch_losses = self.batch_losses, []
        self.pm.hook.zkit_after_step(engine=self, losses=losses)

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """``exclude_frozen_parameters``: leave parameters with ``requires_grad=False`` out of the
        module state (DeepSpeed's argument); a load then keeps the model's own values for them."""
        self._require_on_device("save_checkpoint")
        found = self.pm.hook.zkit_checkpoint_format(engine=self, path=Path(save_dir), tag=tag, operation="save")
        save = _answered(found, "engine.save_checkpoint", "zkit_checkpoint_format").operation("save")
        with phases.phase("save_checkpoint"):
            return save(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                        exclude_frozen_parameters=exclude_frozen_parameters)

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move optimizer state, master, parameters and gradients off the device until
        :meth:`reload_states` (DeepSpeed's call; the partitioner moves them:
        :meth:`zkit.core.partitioner.Partitioner.offload_states`)."""
        self._require_open("offload_states")
        if self.inference_only:
            raise ValueError("offload_states() needs an engine with an optimizer: this one was built without one, "
                             "and holds nothing but the model")
        self.partitioner.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved."""
        self._require_open("reload_states")
        self.partitioner.reload_states(non_blocking)

    def _require_open(self, what: str) -> None:
        """Refuse ``what`` after :meth:`close`: its hooks, communicators and buffers are gone, so a
        closed engine would train without reducing gradients (1 rank) or fail in a collective."""
        if self._closed:
            raise RuntimeError(f"engine.{what} after engine.close(): a closed engine has released its communicators, "
                               f"gradient hooks and buffers and cannot be used again; build a new one with "
                               f"zkit.initialize")

    def _require_on_device(self, what: str) -> None:
        """Refuse ``what`` after :meth:`close`, or while states are offloaded: their storages are
        empty, and a kernel reading one would read no memory at all."""
        self._require_open(what)
        kinds = self.partitioner.offloaded_states()
        if kinds:
            raise RuntimeError(f"engine.{what} while the engine's states are offloaded ({', '.join(kinds)}); "
                               f"call engine.reload_states() first")

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the model's ``state_dict`` in its training dtype to ``save_dir/save_filename``
        (rank 0), DeepSpeed's call. At ZeRO stage 3 it needs
        ``stage3_gather_16bit_weights_on_model_save``; without it nothing is written and the
        call returns False with a warning."""
        self._require_open("save_16bit_model")
        with phases.phase("save_16bit_model"):
            saved = self.pm.hook.zkit_save_16bit_model(
                engine=self, path=Path(save_dir) / save_filename, exclude_frozen_parameters=exclude_frozen_parameters
            )
        return bool(_answered(saved, "engine.save_16bit_model", "zkit_save_16bit_model"))

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """At ZeRO stage 3: the model's ``state_dict`` whole, in its training dtype, on rank 0's
        host (``None`` on the others); every rank calls it."""
        self._require_open("consolidated_16bit_state_dict")
        state = self.pm.hook.zkit_consolidated_16bit_state_dict(
            engine=self, exclude_frozen_parameters=exclude_frozen_parameters
        )
        _answered(state, "engine.consolidated_16bit_state_dict", "zkit_consolidated_16bit_state_dict")
        return state if self.world_comm.rank == 0 else None

    #: DeepSpeed's name, which Accelerate and transformers call
    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict]:
        """Load with the checkpoint format that recognises ``load_dir`` (zkit's, DCP, DeepSpeed's
        with the drop-in, or one a plugin registers), the answer to ``zkit_checkpoint_format``.
        Nothing to load (no tag, no ``latest`` file) is DeepSpeed's warning and ``(None, None)``."""
        self._require_open("load_checkpoint")
        found = self.pm.hook.zkit_checkpoint_format(engine=self, path=Path(load_dir), tag=tag, operation="load")
        load = _answered(found, "engine.load_checkpoint", "zkit_checkpoint_format").operation("load")
        with phases.phase("load_checkpoint"):
            return load(self, Path(load_dir), tag,
                        load_optimizer_states=load_optimizer_states and not load_module_only,
                        load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)

    def close(self) -> None:
        """Free plugin resources (swap files, threads) and monitors. Safe to call twice; any other
        use of the engine afterwards raises, saying it was closed."""
        if self._closed:
            return
        self._closed = True
        self.pm.hook.zkit_engine_close(engine=self)
        self.monitor.close()
        self.partitioner.close()
        self.assembly.close()  # the allocator and every communicator it handed out

    #: DeepSpeed's name (Accelerate's ``free_memory()`` calls it)
    destroy = close


#: what backward and step of an engine built without an optimizer say (its optimizer's step too)
NO_OPTIMIZER = (
    'this engine was built without an optimizer (for inference or evaluation): to train, add "optimizer": '
    '{"type": ..., "params": {...}} to the config, choose one with zkit.Stack(optimizer=...), or pass optimizer= '
    "to zkit.initialize"
)


def _answered(result: Any, where: str, hook: str) -> Any:
    """A ``firstresult`` hook's answer, refused when no plugin gave one (the built-in blocked)."""
    if result is None:
        builtin = " or ".join(builtin_implementers(hook)) or "(none)"
        raise RuntimeError(f"{where}: no plugin answers the hook {hook} (the built-in {builtin} provides it: is it "
                           f"blocked?)")
    return result


def _no_batches(samples: int, micro_batch: int, world: int) -> str:
    """Why the engine's dataloader over ``training_data=`` would give no micro-batch."""
    if samples == 0:
        return "training_data= is an empty dataset (len() is 0): the engine's dataloader would give no micro-batch"
    return (f"training_data= has {samples} samples: over {world} ranks with micro-batches of {micro_batch} and "
            f"dataloader_drop_last, the engine's dataloader gives no micro-batch")


def _given(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def broadcast_module(module: torch.nn.Module, comm: Communicator, src: int, bucket_numel: int = 1 << 25) -> None:
    """Copy the parameters and buffers of global rank ``src`` to the other ranks of ``comm``'s group,
    a bucket of same-dtype tensors per broadcast. ZeRO-3 parameters built partitioned
    (``zkit.zero.Init``) are already one model and are left alone."""
    if comm.world_size == 1:
        return
    tensors = [p.data for p in module.parameters() if not built_partitioned(p)]
    tensors += [b for b in module.buffers()]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), group_tensors in by_dtype.items():
        bucket: list[torch.Tensor] = []
        for t in group_tensors + [None]:  # None flushes the last bucket
            if t is not None and (not bucket or sum(b.numel() for b in bucket) + t.numel() <= bucket_numel):
                bucket.append(t)
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            comm.broadcast(flat, src=src)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket = [t] if t is not None else []


def _enter_all(contexts: list[contextlib.AbstractContextManager]) -> contextlib.AbstractContextManager:
    """The contexts the plugins returned (pluggy leaves out ``None`` answers), as one."""
    if len(contexts) == 1:
        return contexts[0]
    return _entered(contexts) if contexts else contextlib.nullcontext()


@contextlib.contextmanager
def _entered(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _to_half(value: Any) -> Any:
    """``fp16.auto_cast``: floating-point tensors inside the inputs cast to float16."""
    if torch.is_tensor(value):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_half(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_half(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_half(v) for k, v in value.items()}
    return value


def _seed_everything(seed: int) -> None:
    """The config's ``seed``: Python's, NumPy's and torch's generators, as DeepSpeed's
    ``set_random_seed`` does."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _param_groups(
    module: torch.nn.Module, model_parameters: Iterable[Any] | None, client_optimizer: Any = None
) -> list[dict[str, Any]]:
    """torch-style param groups over the module's trainable parameters, the user's grouping and
    per-group options kept. A client optimizer instance brings its own groups, which win over
    ``model_parameters`` (as in DeepSpeed, which steps that optimizer as it was built). Groups that
    list a parameter twice are refused, as ``torch.optim`` refuses them; so are groups that leave
    out a trainable parameter, which torch and DeepSpeed would keep unchanged while it still
    takes gradients (freeze it instead, and the checkpoints keep it as a frozen parameter)."""
    given = "model_parameters"
    if isinstance(client_optimizer, torch.optim.Optimizer):
        model_parameters = [dict(g) for g in client_optimizer.param_groups]
        given = f"the param_groups of optimizer={type(client_optimizer).__name__}"
    if model_parameters is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    names: dict[int, str] = {}
    for name, p in module.named_parameters():  # a tied parameter under its first name
        names.setdefault(id(p), name)
    group_of: dict[int, int] = {}
    for index, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"{given} contains a tensor that is not a parameter of the model")
            if id(p) in group_of:
                where = (f"twice in group {index}" if group_of[id(p)] == index
                         else f"in groups {group_of[id(p)]} and {index}")
                raise ValueError(f"{given} lists the parameter {names[id(p)]!r} {where}: list each parameter once "
                                 f"(torch.optim refuses 'some parameters appear in more than one parameter group')")
            group_of[id(p)] = index
    left_out = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in group_of]
    if left_out:
        shown = ", ".join(repr(n) for n in left_out[:8]) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
        raise ValueError(
            f"{given} leaves out {len(left_out)} trainable parameter(s) of the model: {shown}. torch and DeepSpeed "
            f"would not step them though they take gradients; list them too, or freeze them "
            f"(requires_grad_(False)) before zkit.initialize"
        )
    return groups
