"""The training engine: DeepSpeed's API over a stack of plugins.

    engine, optimizer, dataloader, lr_scheduler = zkit.initialize(model=model, config=cfg)
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The engine itself only orders things in time: micro-steps and accumulation boundaries, loss
scaling, clipping, logging. What is held where and how it is communicated belongs to the plugins
it was built from (partitioner, communicator, optimizer, scheduler, allocator).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable, Iterator

import torch

from zkit import diagnostics, distributed
from zkit.config import ZkitConfig, load_config
from zkit.partition import PartitionContext, Partitioner
from zkit.plugins import ZkitPluginManager, get_plugin_manager
from zkit.precision import LossScaler, cast_model
from zkit.records import OptimizerRecord
from zkit.stack import Stack, configure

log = logging.getLogger("zkit")


def _setup_logging(rank: int) -> None:
    """Show zkit's step lines on rank 0 unless the application configured logging itself."""
    if log.handlers or logging.getLogger().handlers:
        return
    from zkit.monitor import ProgressBarLogHandler

    handler = ProgressBarLogHandler()  # keeps a live progress bar intact on a terminal
    handler.setFormatter(logging.Formatter("[zkit] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


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
) -> tuple["Engine", torch.optim.Optimizer, Any, Any]:
    """Build an :class:`Engine`; returns ``(engine, optimizer, dataloader, lr_scheduler)`` like
    ``deepspeed.initialize``. ``config`` is a DeepSpeed-style dict or JSON path (``config_params``
    and ``args.deepspeed_config`` are accepted too); ``stack`` chooses plugins in Python;
    ``optimizer`` may be a torch optimizer (its class and defaults are rebuilt over the shards) or a
    callable ``param_groups -> optimizer``."""
    if model is None:
        raise ValueError("zkit.initialize needs model=")
    if mpu is not None:
        raise ValueError("mpu= is not supported: tensor/pipeline groups come from zkit-pipeline's topology")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("zkit.initialize needs config= (a dict or a path to a DeepSpeed-style JSON file)")
    engine = Engine(
        model,
        config,
        stack=stack or Stack(),
        model_parameters=model_parameters,
        client_optimizer=optimizer,
        client_lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


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
        distributed.ensure_initialized()
        self.pm: ZkitPluginManager = get_plugin_manager(extra_plugins=stack.plugins)
        # A model that brings its own data-parallel group (a pipeline stage's replicas) trains over
        # that group: batch arithmetic and the partitioner's collectives use it, not the world.
        dp_group = getattr(model, "data_parallel_group", None)
        world = torch.distributed.get_world_size(dp_group)
        self.config: ZkitConfig = load_config(config, world_size=world, sections=self.pm.config_sections())
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self.stack, self.records = configure(self.pm, stack, self.config)

        self.device = distributed.default_device()
        self.dtype = self.config.dtype
        self.module = cast_model(model, self.dtype, self.device)
        self.comm = self.records["communicator"].factory(dp_group, self.config)
        #: the whole world (a pipeline's point-to-point transfers); the same object without a group
        self.world_comm = self.comm if dp_group is None else self.records["communicator"].factory(None, self.config)
        self.allocator = self.records["allocator"].factory(self.device, self.config)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        _setup_logging(self.rank)

        opt_record, opt_params = self._optimizer_choice(client_optimizer)
        self.partitioner: Partitioner = self.records["partitioner"].factory(
            PartitionContext(
                module=self.module,
                param_groups=_param_groups(self.module, model_parameters),
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
        if getattr(self.optimizer, "wants_communicator", False):
            self.optimizer.comm = self.comm
        self.lr_scheduler = self._lr_scheduler(client_lr_scheduler)
        self.loss_scaler = LossScaler.from_config(self.config.fp16)
        self.training_dataloader = self._dataloader(training_data, collate_fn) if training_data is not None else None

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._grad_norm: float | None = None
        self._no_sync = False
        self._losses: list[torch.Tensor] = []
        self._step_started = time.perf_counter()
        self.tokens_per_sample: int | None = None  # set it to log tokens/s
        #: compute the global gradient norm every step even without fp16 or clipping (for logging)
        self.track_grad_norm = False
        self._closed = False
        from zkit.monitor import Monitor, StepProbe, ThroughputMeter

        self.monitor = Monitor(self.config, self.rank)
        self.throughput = ThroughputMeter()
        #: FLOPs and saved activations of the first training micro-step, for the step log line
        self.step_probe = StepProbe(self.module)
        from zkit import checkpointing

        checkpointing.configure(self)  # the activation_checkpointing section applies to this engine
        self.pm.hook.zkit_engine_setup(engine=self)

    # -- construction helpers ----------------------------------------------------------------------
    def _optimizer_choice(self, client: Any) -> tuple[OptimizerRecord, dict[str, Any]]:
        record = self.records["optimizer"]
        if record is not None:
            params = dict(self.config.optimizer.params) if self.config.optimizer is not None else {}
            if self.stack.optimizer is not None and self.config.optimizer is None:
                params = {}
            return record, params
        if client is None:
            raise ValueError(
                'no optimizer: add "optimizer": {"type": ..., "params": {...}} to the config, choose one with '
                "zkit.Stack(optimizer=...), or pass optimizer= to zkit.initialize"
            )
        if isinstance(client, torch.optim.Optimizer):
            cls, defaults = type(client), dict(client.defaults)
            factory = lambda groups, **kw: cls(groups, **{**defaults, **kw})  # noqa: E731
            name = cls.__name__
        elif callable(client):
            factory = lambda groups, **kw: client(groups)  # noqa: E731
            name = getattr(client, "__name__", "client")
        else:
            raise TypeError(f"optimizer= must be a torch optimizer or a callable, got {client!r}")
        return OptimizerRecord(name=f"client:{name}", factory=factory, dist="client"), {}

    def _lr_scheduler(self, client: Any) -> Any:
        record = self.records["scheduler"]
        if record is not None:
            if record.kind != "lr":
                raise ValueError(f"scheduler {record.name!r} is a {record.kind} schedule, not an LR schedule")
            params = dict(self.config.scheduler.params) if self.config.scheduler is not None else {}
            return record.factory(self.optimizer, **params)
        if client is None:
            return None
        return client(self.optimizer) if callable(client) and not hasattr(client, "step") else client

    def _dataloader(self, data: Any, collate_fn: Any) -> torch.utils.data.DataLoader:
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=self.config.seed or 0
        )
        return torch.utils.data.DataLoader(
            data,
            batch_size=self.config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=True,
        )

    # -- DeepSpeed-compatible accessors -------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Collective kind -> ``{"calls", "bytes"}`` sent by this rank since start (or reset)."""
        return self.comm.stats()

    def memory(self) -> dict[str, Any]:
        """This rank's memory: model-state bytes by purpose, and the process's RSS."""
        from zkit.monitor import memory_snapshot

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
        # the probe inside the partitioner's context: its saved-tensor hooks pass on to stage 3's
        with diagnostics.phase("forward"), self.partitioner.forward_context(), self.step_probe.forward():
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for the backward passes inside (accumulate locally)."""
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
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}")
        self.pm.hook.zkit_before_backward(engine=self, loss=loss)
        self._losses.append(loss.detach().float())
        scaled = loss.float() * self.loss_scaler.scale if self.loss_scaler.enabled else loss
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        boundary = self.is_gradient_accumulation_boundary() and not self._no_sync
        with diagnostics.phase("backward"):
            with self.partitioner.backward_context(boundary), self.step_probe.backward():
                scaled.backward(retain_graph=retain_graph)
            self.partitioner.after_backward(boundary)
        self.pm.hook.zkit_after_backward(engine=self)
        return loss

    def step(self) -> None:
        """End a micro-step; at an accumulation boundary, run the optimizer step."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size
        if not boundary:
            return
        self.run_optimizer_step()
        self.global_steps += 1
        self._after_step()

    def run_optimizer_step(self) -> bool:
        """Run the optimizer step now, through the ``zkit_optimizer_step`` hook; returns whether it
        was applied (False when fp16 overflow skipped it). ``step()`` calls it at an accumulation
        boundary; a ``zkit_train_batch`` implementation that drives its own micro-batches (a
        pipeline schedule) calls it where its schedule steps."""
        with diagnostics.phase("optimizer.step"):
            self._step_applied = bool(self.pm.hook.zkit_optimizer_step(engine=self))
        return self._step_applied

    def finish_global_batch(self, loss: torch.Tensor) -> None:
        """Account one global batch run by a ``zkit_train_batch`` implementation outside
        ``forward``/``backward``/``step``: advance the micro-step, sample and step counters as
        ``gradient_accumulation_steps`` calls of ``step()`` would, and log ``loss`` as the batch's
        loss in the step line and monitors."""
        m = self.gradient_accumulation_steps()
        self.micro_steps += m
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size * m
        self.global_steps += 1
        self._losses = [loss.detach().float().reshape(())]
        self._after_step()

    def wait_for_parameters(self) -> None:
        """Block until the parameters hold their values after the last step. Only needed with
        ``zero_optimization.overlap_param_gather``, by code that reads ``module.parameters()``
        between ``step()`` and the next forward (an EMA copy, a weight statistic); forward,
        ``state_dict()``, checkpoints and ``GatheredParameters`` wait on their own."""
        self.partitioner.wait_for_parameters()

    def apply_step(self) -> bool:
        """The optimizer step proper: global norm and overflow check, loss scale, clipping, the
        partitioner's step, the LR schedule. Returns False when the step was skipped."""
        # The global norm costs a pass over the gradients and an all-reduce: only when fp16 needs
        # its overflow check, clipping needs the norm, or the user asked for it.
        needs_norm = self.loss_scaler.enabled or self.config.gradient_clipping > 0 or self.track_grad_norm
        norm = float(self.partitioner.grad_norm()) if needs_norm else 0.0
        overflow = needs_norm and not torch.isfinite(torch.tensor(norm)).item()
        scale = self.loss_scaler.scale  # the scale this batch's gradients carry (1.0 unless fp16)
        if self.loss_scaler.enabled:
            self.loss_scaler.update(overflow, self.global_steps + 1)
        if overflow:
            self.skipped_steps += 1
            self._grad_norm = None
            self.partitioner.zero_grad()
            if self.rank == 0:
                log.warning(
                    "step %d: gradient overflow, step skipped; loss scale now %g",
                    self.global_steps + 1,
                    self.loss_scaler.scale,
                )
            return False
        true_norm = norm / scale
        factor = 1.0 / scale
        clip = self.config.gradient_clipping
        if clip > 0 and true_norm > clip:
            factor *= clip / (true_norm + 1e-6)
        self._grad_norm = true_norm if needs_norm else None
        self.partitioner.step(factor)
        self.partitioner.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one global batch (``gradient_accumulation_steps`` micro-batches) from ``data_iter``
        (default: the engine's own dataloader, cycled)."""
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() needs a data iterator or training_data= at initialize")
            data_iter = self._cycle()
        return self.pm.hook.zkit_train_batch(engine=self, data_iter=data_iter)

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Evaluate one global batch (``gradient_accumulation_steps`` micro-batches) from
        ``data_iter`` without gradients; returns the mean loss (a pipeline: on every stage)."""
        return self.pm.hook.zkit_eval_batch(engine=self, data_iter=iter(data_iter))

    def _cycle(self) -> Iterator[Any]:
        if not hasattr(self, "_data_cycle"):
            def forever():
                epoch = 0
                while True:
                    self.training_dataloader.sampler.set_epoch(epoch)
                    yield from self.training_dataloader
                    epoch += 1

            self._data_cycle = forever()
        return self._data_cycle

    # -- logging ----------------------------------------------------------------------------------
    def _after_step(self) -> None:
        now = time.perf_counter()
        elapsed, self._step_started = now - self._step_started, now
        samples = self.train_batch_size()
        self.throughput.update(samples, elapsed, tokens=samples * self.tokens_per_sample if self.tokens_per_sample else None)
        loss = torch.stack(self._losses).mean().item() if self._losses else float("nan")
        self._losses = []
        self.last_loss = loss
        every = self.config.steps_per_print
        if (every and self.global_steps % every == 0) or self.config.memory_breakdown:
            self._log_step(loss)

    def _log_step(self, loss: float) -> None:
        from zkit.monitor import format_memory_line, format_step_line, memory_snapshot

        mem = memory_snapshot(self._memory_stats())
        mem["buffers_bytes"] = sum(b.numel() * b.element_size() for b in self.module.buffers())
        probe = self.step_probe
        if probe.activation_bytes is not None:
            mem["activations_peak_bytes"] = probe.activation_bytes
        all_mem = self.comm.all_gather_object(mem) if self.world_size > 1 else [mem]
        throughput = self.throughput.metrics()
        metrics = {
            "loss": loss,
            "lr": self.get_lr()[0] if self.optimizer.param_groups else 0.0,
            **throughput,
            **probe.metrics(throughput["step_time_s"], self.gradient_accumulation_steps()),
            "rss_per_rank": [m.get("rss_bytes", 0) for m in all_mem],
            "total_steps": getattr(self.lr_scheduler, "total_num_steps", None),
        }
        if self.loss_scaler.enabled:
            metrics["loss_scale"] = self.loss_scaler.scale
        if self._grad_norm is not None:
            metrics["grad_norm"] = self._grad_norm
        if self.rank == 0:
            log.info(format_step_line(self.global_steps, metrics))
            log.info(format_memory_line(all_mem))
            self.monitor.write_events(
                [(f"Train/{k}", float(v), self.global_steps) for k, v in metrics.items() if isinstance(v, (int, float))]
            )

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True) -> str:
        from zkit.checkpoint import save_checkpoint

        with diagnostics.phase("save_checkpoint"):
            return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict]:
        from zkit.checkpoint import load_checkpoint

        with diagnostics.phase("load_checkpoint"):
            return self._load(load_dir, tag, load_optimizer_states and not load_module_only,
                              load_lr_scheduler_states and not load_module_only)

    def _load(self, load_dir: str, tag: str | None, optimizer_states: bool, lr_states: bool) -> tuple[str | None, dict]:
        from zkit.checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=optimizer_states,
            load_lr_scheduler_states=lr_states,
        )

    def close(self) -> None:
        """Free plugin resources (swap files, threads) and monitors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.pm.hook.zkit_engine_close(engine=self)
        self.monitor.close()
        self.partitioner.close()
        self.comm.close()
        if self.world_comm is not self.comm:
            self.world_comm.close()


def _param_groups(module: torch.nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """torch-style param groups over the module's trainable parameters, the user's grouping and
    per-group options kept. Trainable parameters the user did not list join the first group."""
    if model_parameters is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    owned = {id(p) for p in module.parameters()}
    for g in groups:
        for p in g["params"]:
            if id(p) not in owned:
                raise ValueError("model_parameters contains a tensor that is not a parameter of the model")
    return groups
