"""Every hook of zkit, in one file. Each docstring is the plugin author's manual for that hook.

A plugin is a plain module (or object) with functions marked ``@zkit.hookimpl`` whose names are
hook names below; it is found through the entry-point group ``zkit``::

    # pyproject.toml of your distribution
    [project.entry-points.zkit]
    myplugin = "my_package.zkit_plugin"

zkit's own defaults are plugins of these very hooks
(``zkit.core.plugin_manager.BUILTIN_PLUGINS``), registered ``trylast`` so an installed plugin's answer to a ``firstresult`` hook wins. A function named ``zkit_*`` that matches
no hook here is an error at start-up (a misspelled hook fails loudly).

There are two kinds of hooks:

* **Registration hooks** (``zkit_register_*``, ``zkit_config_sections``) yield small frozen
  records (:mod:`zkit.core.records`). Two records with one name is an error naming both distributions.
  The manager calls them through pluggy's hook caller once per plugin that answers (so each record
  is known with its distribution): ``wrapper=True`` implementations wrap each of those calls, and
  ``ZKIT_TRACE`` shows them.
* **Lifecycle hooks** are called at named moments of a run with what the moment needs: the
  optimizer step's hooks a :class:`~zkit.core.step_context.StepContext`, the backward hooks a
  :class:`~zkit.core.microstep.BackwardContext`, the set-up hooks the parts they build from. The
  hooks that still get the whole engine say why in their manual: they attach to it or release
  what they attached, drive it as a training loop does, report on it, or save and restore all of
  it.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pathlib import Path

    import torch

    from zkit.core.assembly import Assembly
    from zkit.core.config import ZkitConfig
    from zkit.core.engine import Engine
    from zkit.core.records import (
        AllocatorRecord,
        AttentionRecord,
        CheckpointFormatRecord,
        CommunicatorRecord,
        ConfigSectionRecord,
        OptimizerRecord,
        PartitionerRecord,
        ProviderRecord,
        SchedulerRecord,
    )
    from zkit.core.stack import Stack
    from zkit.core.stash import Stash
    from zkit.core.step_context import StepContext
    from zkit.core.metrics import MetricsMonitor
    from zkit.core.microstep import BackwardContext

PROJECT = "zkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------
# Registration: one hook per family
# --------------------------------------------------------------------------------------------


@hookspec
def zkit_register_partitioners() -> Iterable[PartitionerRecord]:
    """Yield :class:`~zkit.core.records.PartitionerRecord` s: ways to split model states over
    data-parallel ranks. Selected by name (``Stack(partitioner="zero2")``), or by a plugin's
    ``zkit_configure`` answer (the built-in ``zkit.partitioners`` picks ``zero{stage}`` from its
    ``zero_optimization`` section).

    The factory gets a :class:`zkit.core.partitioner.PartitionContext` and returns a
    :class:`zkit.core.partitioner.Partitioner`. Example::

        @zkit.hookimpl
        def zkit_register_partitioners():
            yield PartitionerRecord(name="mystage", stage=None, factory=MyPartitioner)
    """


@hookspec
def zkit_register_communicators() -> Iterable[CommunicatorRecord]:
    """Yield :class:`~zkit.core.records.CommunicatorRecord` s: implementations of
    :class:`zkit.core.communicator.Communicator` (all-reduce, reduce-scatter, all-gather, all-to-all,
    broadcast, point-to-point) with byte counters. The default is ``"torch"``
    (torch.distributed). Example::

        @zkit.hookimpl
        def zkit_register_communicators():
            yield CommunicatorRecord(name="onebit", factory=OneBitCommunicator)
    """


@hookspec
def zkit_register_optimizers() -> Iterable[OptimizerRecord]:
    """Yield :class:`~zkit.core.records.OptimizerRecord` s, selected by
    ``"optimizer": {"type": name}`` (case-insensitive) or ``Stack(optimizer=name)``.

    Declare the per-parameter state tensors in ``state_names`` so that every ZeRO stage can shard
    and checkpoint the optimizer without knowing it. Example::

        @zkit.hookimpl
        def zkit_register_optimizers():
            yield OptimizerRecord(name="lion", factory=Lion, state_names=("exp_avg",))
    """


@hookspec
def zkit_register_schedulers() -> Iterable[SchedulerRecord]:
    """Yield :class:`~zkit.core.records.SchedulerRecord` s: learning-rate schedules (``kind="lr"``,
    selected by ``"scheduler": {"type": name, "params": {...}}``) and step schedules
    (``kind="step"``: instruction streams for one global batch, e.g. pipeline schedules)."""


@hookspec
def zkit_register_allocators() -> Iterable[AllocatorRecord]:
    """Yield :class:`~zkit.core.records.AllocatorRecord` s: where flat buffers live (device memory,
    pinned host memory, NVMe files). The factory returns a :class:`zkit.core.allocator.Allocator`; the
    partitioner asks it for every flat buffer, naming the buffer's purpose (``"param"``,
    ``"grad"``, ``"master"``, ``"optim_state"``, ``"bucket"``), so an allocator can place, say,
    master weights and optimizer state on the host. Three typed methods, ``None`` by default, let
    it take over more (protocols in ``zkit/core/stores.py``): ``master_store(shard_sizes)`` (stages 2-3:
    a ``MasterStore`` keeping the fp32 master and its gradients elsewhere), ``param_shard_store(dtype)``
    (stage 3: a ``ParamShardStore`` keeping parameter shards elsewhere, read ahead of their gathers)
    and ``optimizer_stepper()`` (a function run in place of ``optimizer.step()``). zkit-offload's
    ``nvme`` allocator answers all three. ``grads_beside_master()`` (default: whether
    ``"master_grad"`` and ``"grad"`` are placed apart) makes stages 2-3 copy each reduced gradient
    chunk into fp32 ``"master_grad"`` shards beside the master instead of keeping ``"grad"`` shards
    (ZeRO-Offload: no gradient memory on the device)."""


@hookspec
def zkit_register_attention() -> Iterable[AttentionRecord]:
    """Yield :class:`~zkit.core.records.AttentionRecord` s: attention implementations that a model
    builds with :func:`zkit.core.attention.build_attention` by name (``"dense"``, ``"block_sparse"``...)."""


@hookspec
def zkit_register_checkpoint_formats() -> Iterable[CheckpointFormatRecord]:
    """Yield :class:`~zkit.core.records.CheckpointFormatRecord` s: checkpoint formats zkit reads or
    writes. ``engine.load_checkpoint(path, tag)`` asks every format's ``detect(path, tag)`` (an
    installed plugin's before the built-ins') and loads with the first that answers; a directory
    no format recognises loads as zkit's own, whose errors name what is missing.
    ``engine.save_checkpoint`` writes the ``"zkit"`` format (both choices are the built-in answer
    to :func:`zkit_checkpoint_format`); ``zkit consolidate`` reads a
    checkpoint through its format's ``pieces`` and writes ``--format NAME`` through that format's
    ``export``. Built in: ``"zkit"`` (load, save, pieces), ``"dcp"`` (PyTorch Distributed
    Checkpoint: load, export) and ``"hf"`` (a ``save_pretrained`` directory: export); the
    ``deepspeed`` drop-in adds ``"deepspeed"`` (load, pieces). Example::

        @zkit.hookimpl
        def zkit_register_checkpoint_formats():
            yield CheckpointFormatRecord(
                name="myformat", detect=lambda path, tag: (path / "my.index").is_file(), load=load_mine
            )
    """


@hookspec
def zkit_config_sections() -> Iterable[ConfigSectionRecord]:
    """Yield :class:`~zkit.core.records.ConfigSectionRecord` s for the config keys the plugin owns
    (``"sparse_attention"``, ``"zero_optimization.offload_optimizer"``). The loader structures the
    user's dict into the record's attrs ``schema`` and rejects unknown keys with the closest valid
    one. A key that an installed distribution's :class:`~zkit.core.records.ProviderRecord` says
    another distribution provides (:func:`zkit_register_providers`) is, without that one, an error
    naming it. Read the section back with ``config.section(path)`` (``None`` when
    the user gave none, unless the record sets ``default_when_absent``: then the schema's
    defaults)."""


@hookspec
def zkit_register_providers() -> Iterable[ProviderRecord]:
    """Yield :class:`~zkit.core.records.ProviderRecord` s naming the distribution that provides a
    record name, a config key or a hook's answer, for when it is *not* installed: an unknown name,
    a config key nothing installed registers, or an unanswered hook is then an error saying what
    to install. A distribution that is installed registers its names itself; these records are
    for the distributions it knows of that may be missing (zkit's built-in ``zkit.distributions``
    answers for the distributions zkit ships apart). Two records for one name are an error naming
    both distributions. Example::

        @zkit.hookimpl
        def zkit_register_providers():
            yield ProviderRecord(kind="optimizer", name="myadam", provider="my-zkit-kernels")
            yield ProviderRecord(kind="config", name="my_section", provider="my-zkit-kernels")
    """


# --------------------------------------------------------------------------------------------
# Lifecycle
# --------------------------------------------------------------------------------------------


@hookspec
def zkit_configure(config: ZkitConfig, device: torch.device | None) -> Stack | None:
    """Called once per :func:`zkit.initialize`, after the config is loaded and before anything is
    built. Return a :class:`zkit.Stack` to choose records this config needs (the offload plugin
    answers ``offload_optimizer.device == "cpu"`` with ``Stack(allocator="host",
    optimizer="cpu_adam")``), or ``None``. Stacks returned here are overridden by a stack the
    user passes to ``initialize``, and override a built-in plugin's choice for the same family
    (built-ins answer as defaults); two installed plugins choosing different records for one
    family is an error naming both.

    ``device`` is the device the engine trains on, so that a record suited to some devices only
    is chosen on those (a plugin whose kernel runs on GPUs answers on ``cuda`` only and leaves
    other devices to the built-ins); ``None`` when the caller builds no engine
    (``zkit.zero.Init``). An implementation may leave the argument out."""


@hookspec(firstresult=True)
def zkit_client_optimizer(optimizer: Any) -> OptimizerRecord | None:
    """Turn the ``optimizer=`` given to :func:`zkit.initialize` into the
    :class:`~zkit.core.records.OptimizerRecord` the partitioner builds over its shards. Called
    once per engine, before the partitioner is built, when neither the config nor the stack
    chooses an optimizer (a client optimizer wins over a config's section, with a warning, as in
    DeepSpeed). ``optimizer`` is a torch optimizer instance (whose ``param_groups`` are the groups
    partitioned), a callable ``param_groups -> optimizer``, or ``None``: then the engine is built
    for inference or evaluation (``engine.inference_only``: backward and step refuse) and the
    record's optimizer only holds the parameter groups.

    The built-in answer (``trylast``, :mod:`zkit.optim.client`) rebuilds an instance's class and
    constructor options over the shards and makes the client's object the built one, calls a
    callable, and refuses anything else. Return ``None`` to leave it to the next plugin; no
    answer at all is an error naming this hook. First non-None answer wins."""


@hookspec(firstresult=True)
def zkit_client_lr_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Turn the ``lr_scheduler=`` given to :func:`zkit.initialize` into the schedule the engine
    steps (``engine.lr_scheduler``; it has ``step()``, ``get_last_lr()``, ``state_dict()`` and
    ``load_state_dict()``). Called once per engine, after the engine's optimizer is built
    (``optimizer``, the one the schedule must step), when a scheduler was given and neither the
    config nor the stack chooses one.

    The built-in answer (``trylast``, :mod:`zkit.optim.client`) calls a callable ``optimizer ->
    scheduler`` with ``optimizer``, and moves a scheduler built over another optimizer
    onto it (learning rates carried over). Return ``None`` to leave it to the next plugin; no
    answer at all is an error naming this hook. First non-None answer wins."""


@hookspec
def zkit_engine_setup(engine: Engine) -> None:
    """Called once when the engine is fully built (partitioner, optimizer and LR schedule in
    place), before the first forward. Attach monitors, prefetchers, hang detectors here. The
    built-in host-memory plugin (``trylast``: after the others) gives back to the system the host
    memory that building freed (``ZKIT_HOST_MALLOC``, :mod:`zkit.host_memory`).

    It gets the whole engine because it is where a plugin attaches to the engine as built (the
    activation-checkpointing section applied to ``engine.module``, a 1-bit optimizer attached to
    ``engine.partitioner``, a monitor reading the config): keep what you make in
    ``engine.stash``, not in attributes of the engine."""


@hookspec(firstresult=True)
def zkit_sequence_parallel(
    module: torch.nn.Module, assembly: Assembly, stash: Stash, config: ZkitConfig, device: torch.device, size: int
) -> Any:
    """Set up sequence parallelism for an engine whose config's ``sequence_parallel_size`` is
    ``size`` (> 1) and return the torch.distributed process group of this rank's sequence-parallel
    ranks; ``module`` is the engine's model (cast, not yet partitioned), ``assembly`` where
    communicators over new groups come from (:meth:`~zkit.core.assembly.Assembly.communicator`),
    ``stash`` the engine's plugin state, ``config`` and ``device`` the engine's: ranks ``r * size`` to ``r * size + size - 1`` split one sequence between them and count
    as one data-parallel replica in the batch sizes; the partitioner still shards over every rank.
    Called once per engine (collective: every rank calls it), after the assembly exists and
    before the partitioner is built; the engine keeps the answer as
    ``engine.sequence_parallel_group``. The answer makes the model compute on slices of each
    sequence (zkit-sequence binds its Ulysses attention and its loss to the group's communicator)
    and refuses, here, at initialize, what it cannot run. No answer is an error naming the key.
    First non-None answer wins."""


@hookspec
def zkit_prepare_model(model: torch.nn.Module, stage: int, world_size: int) -> None:
    """Called once per engine before it casts the model to its dtype and device and partitions
    it. ``stage`` is the chosen partitioner record's ZeRO stage (0 for a partitioner of no stage)
    and ``world_size`` the ranks it partitions over. A plugin that changed the model before
    :func:`zkit.initialize` makes it fit the chosen stack here: the built-in ZeRO plugin gathers
    the units :class:`zkit.zero.Init` partitioned that this partitioner would not keep as they
    are."""


@hookspec
def zkit_model_built_partitioned(assembly: Assembly) -> None:
    """Called when a context that builds a model partitioned before any engine exists
    (:class:`zkit.zero.Init`) exits, with the :class:`~zkit.core.assembly.Assembly` it took its
    communicator and allocator from. Each module's full tensors were freed as it was partitioned:
    the built-in ``zkit.host_memory`` hands that memory back to the system here."""


@hookspec(firstresult=True)
def zkit_make_monitor(config: ZkitConfig, rank: int) -> MetricsMonitor | None:
    """Return the object behind ``engine.monitor``, for the engine's ``config`` on data-parallel
    ``rank``: it receives the step metrics as ``(tag, value, step)`` events on rank 0, and user code may write its own events to it (as DeepSpeed's
    ``engine.monitor.write_events``). It follows :class:`zkit.core.metrics.MetricsMonitor`.
    The built-in answer (``trylast``, :mod:`zkit.monitor`) opens the writers the ``csv_monitor``
    and ``tensorboard`` sections enable; a plugin answering first replaces it (wrap it with
    ``wrapper=True`` to add a writer beside it). First non-None answer wins."""


@hookspec(firstresult=True)
def zkit_train_batch(engine: Engine, data_iter: Iterable[Any]) -> Any:
    """Run one whole global batch (all its micro-batches) and return the mean loss.

    ``engine.train_batch(data_iter)`` calls this. The built-in implementation (``trylast``) takes
    ``gradient_accumulation_steps`` micro-batches from ``data_iter`` and runs
    forward/backward/step on each. A pipeline plugin answers with its own schedule. First non-None
    answer wins. It gets the whole engine because an answer drives it as a training loop does
    (``engine(batch)``, ``engine.backward``, ``engine.step``; a schedule of its own runs
    ``engine.micro_step_protocol`` and ``engine.run_optimizer_step`` and accounts the batch with
    ``engine.finish_global_batch``)."""


@hookspec(firstresult=True)
def zkit_eval_batch(engine: Engine, data_iter: Iterable[Any]) -> Any:
    """Evaluate one global batch without gradients and return its mean loss.

    ``engine.eval_batch(data_iter)`` calls this. The built-in implementation (``trylast``) takes
    ``gradient_accumulation_steps`` micro-batches from ``data_iter`` and runs the model's forward on
    each under ``torch.no_grad()`` in eval mode (restoring train mode after). A pipeline plugin
    answers with a forward-only pass through its stages. No gradient, optimizer state or step
    counter changes. First non-None answer wins. It gets the whole engine for the reason
    :func:`zkit_train_batch` does: an answer drives the engine's forward."""


@hookspec
def zkit_before_backward(micro_step: BackwardContext, loss: Any, boundary: bool) -> None:
    """Called before every backward pass that accumulates parameter gradients, by the one
    micro-step protocol (:class:`zkit.core.microstep.MicroStep`) that ``engine.backward(loss)`` and
    schedules driving their own micro-batches (a pipeline stage's backward instructions) share.
    ``micro_step`` (:class:`~zkit.core.microstep.BackwardContext`) holds the partitioner, the
    data-parallel communicator, the allocator and the stash.
    ``loss`` is the micro-batch's loss before scaling, or ``None`` on a pipeline stage that
    back-propagates the gradient it received from the next stage. ``boundary``: this backward
    ends the batch (the optimizer step comes next); zkit-offload's ``step_in_backward`` starts
    stepping sub-groups here. An implementation may leave out the arguments it does not use."""


@hookspec
def zkit_after_backward(micro_step: BackwardContext) -> None:
    """Called after every backward pass of the micro-step protocol (see
    :func:`zkit_before_backward`), once back-propagation and the partitioner's gradient reduction
    of this micro-step have finished."""


@hookspec
def zkit_phase(engine: Engine, phase: str) -> contextlib.AbstractContextManager | None:
    """Return a context manager the engine enters around one phase of its work, or ``None``.

    ``phase`` is ``"forward"`` (the partitioner's forward context and the model's forward),
    ``"backward"`` (the micro-step protocol: back-propagation and the partitioner's gradient
    reduction) or ``"step"`` (the optimizer step at a boundary). The contexts of every plugin
    are entered in hook order and left in reverse. The built-in telemetry plugin times the
    phases here (``wall_clock_breakdown``). Keep it cheap: it runs three times per micro-step.
    It gets the whole engine, as :func:`zkit_after_step` does, for a plugin that reports on it."""


@hookspec
def zkit_model_pass(engine: Engine, direction: str) -> contextlib.AbstractContextManager | None:
    """Return a context manager the engine enters around the model's own computation, or
    ``None``: ``direction`` is ``"forward"`` (the module's forward, inside the partitioner's
    forward context, so saved-tensor hooks installed here come after stage 3's) or
    ``"backward"`` (the autograd backward call alone, inside the micro-step protocol). The
    built-in telemetry plugin counts the first micro-step's FLOPs and activations here. It gets
    the whole engine, as :func:`zkit_after_step` does, for a plugin that reports on it."""


@hookspec
def zkit_after_step(engine: Engine, losses: list[torch.Tensor]) -> None:
    """Called after every global step (an optimizer step, applied or skipped for an fp16
    overflow), with ``engine.global_steps`` already advanced. ``losses`` are the detached
    losses of the batch's micro-steps, still on the device: read their values only when you
    need them (reading one waits for the device). The built-in telemetry plugin logs the step
    line and hands the metrics to ``engine.monitor`` here. It gets the whole engine because a
    report reads what the engine's public accessors say (``global_steps``, ``get_lr()``,
    ``loss_scale``, ``get_global_grad_norm()``, ``comm_stats()``, ``memory()``) and writes to
    ``engine.monitor``; read, do not change."""


@hookspec(firstresult=True)
def zkit_optimizer_step(step: StepContext) -> bool | torch.Tensor | None:
    """Perform the optimizer step at a gradient-accumulation boundary and return whether the
    step was applied (``False`` when skipped because of an fp16 overflow; a 0-dim bool tensor
    when the step decided on the device, read only by ``engine.was_step_applied()``).

    ``step`` (:class:`zkit.core.step_context.StepContext`) is what a step reads and may change,
    not the engine: its number, the config, this batch's losses, the loss scaler, the
    partitioner, the data-parallel communicator, the LR schedule, the stash, ``grad_norm()`` (the
    answer of :func:`zkit_grad_norm`) and ``record(applied, grad_norm)``, the one way to say what
    came of the step (``engine.skipped_steps``, ``get_global_grad_norm()``).

    The built-in implementation (``trylast``) is :func:`zkit.train_loop.optimizer_step.apply_step`:
    global gradient norm and overflow check, loss-scale update, clipping, the partitioner's step,
    the LR schedule, and the skipped-step policy (``nonfinite_steps_limit``); it records the
    outcome through ``step.record``. Wrap it
    (``@hookimpl(wrapper=True)``) to time or profile the step; answer it to replace the step (a
    1-bit optimizer that exchanges momentum instead of gradients)."""


@hookspec(firstresult=True)
def zkit_grad_norm(step: StepContext) -> Any:
    """Return the global L2 norm of this batch's gradients, still multiplied by the loss scale,
    as a 0-dim fp32 tensor; ``inf`` or ``nan`` when any rank has an overflow.

    The engine asks at an accumulation boundary when it needs the norm: fp16's overflow check,
    ``gradient_clipping``, or ``engine.track_grad_norm``; ``step`` is the optimizer step's
    :class:`~zkit.core.step_context.StepContext` (``step.partitioner``, ``step.comm``,
    ``step.stash``, ``step.number``...). The built-in answer (``trylast``) is
    ``step.partitioner.grad_norm()``, the norm over the data-parallel group. A plugin that
    changes what "global" means wraps it, so that several such plugins compose (each sees the
    answer of those inside it)::

        @zkit.hookimpl(wrapper=True)
        def zkit_grad_norm(step):
            norm = yield          # the partitioner's norm, or the next wrapper's
            sq = norm.float().reshape(1) ** 2
            my_group_comm.all_reduce(sq, "sum")   # e.g. over the model-parallel ranks
            return sq.sqrt()[0]

    Every rank must return the same value (they skip and clip together) and issue the same
    collectives. zkit-onebit's wrapper (``trylast``: innermost) averages the local norms while a
    1-bit optimizer has reduction off; zkit-pipeline's sums over the pipeline and tensor ranks."""


@hookspec
def zkit_checkpoint_save(engine: Engine) -> dict[str, Any] | None:
    """Return extra state to store in this rank's checkpoint file (tensors, numbers, strings,
    nested dicts and lists; no arbitrary objects: checkpoints are loaded with
    ``weights_only=True``). The returned dict is stored under the plugin's own key; return
    ``None`` for nothing. It gets the whole engine because a plugin's state lives where it attached
    it at :func:`zkit_engine_setup` (an optimizer's, a communicator's, the stash)."""


@hookspec
def zkit_checkpoint_load(engine: Engine, state: dict[str, Any]) -> None:
    """Restore what ``zkit_checkpoint_save`` stored. ``state`` maps each plugin's key to what it
    returned at save time (missing keys when the checkpoint was written without the plugin). It
    gets the whole engine for the reason :func:`zkit_checkpoint_save` does."""


@hookspec(firstresult=True)
def zkit_checkpoint_format(
    engine: Engine, path: Path, tag: str | None, operation: str
) -> CheckpointFormatRecord | None:
    """The checkpoint format (a :class:`~zkit.core.records.CheckpointFormatRecord` providing
    ``operation``) that ``engine.save_checkpoint`` (``operation="save"``) or
    ``engine.load_checkpoint`` (``"load"``) uses for the directory ``path`` and ``tag`` (``None``:
    the one the save chooses, or the one the ``latest`` file names). The engine then calls the
    record's ``save`` or ``load``. The built-in answer (``trylast``, :mod:`zkit.checkpoint.plugin`)
    saves in ``"zkit"`` and loads with the first registered format whose ``detect(path, tag)``
    recognises the directory, else ``"zkit"``, whose ``load`` warns and returns ``(None, None)``
    when there is nothing to load (no tag, no ``latest`` file). Answer it to route a run's
    checkpoints to a format of your own. First non-None answer wins. It gets the whole engine
    because the format it answers saves or fills all of it (the record's ``save(engine, ...)`` and
    ``load(engine, ...)``), so the choice may depend on any of it."""


@hookspec(firstresult=True)
def zkit_save_16bit_model(engine: Engine, path: Path, exclude_frozen_parameters: bool) -> bool | None:
    """``engine.save_16bit_model``: write the model's ``state_dict`` in its training dtype to
    ``path`` (one file, written by the world's first rank; every rank calls this) and return whether
    it was written. ``None`` leaves it to the next plugin, on every rank alike. The built-in
    (``zkit.checkpoint.sixteen_bit``) gathers partitioned parameters module by module, and at ZeRO
    stage 3 without ``stage3_gather_16bit_weights_on_model_save`` writes nothing, warns and returns
    False, as DeepSpeed does. It gets the whole engine because gathering the model's state takes
    its module, partitioner, communicators and config."""


@hookspec(firstresult=True)
def zkit_consolidated_16bit_state_dict(engine: Engine, exclude_frozen_parameters: bool) -> dict | None:
    """``engine.consolidated_16bit_state_dict`` (ZeRO stage 3): the model's whole ``state_dict``
    in its training dtype on the host of the world's first rank, an empty dict on the others (the
    engine hands them ``None``); every rank calls it. ``None`` leaves it to the next plugin, on
    every rank alike. It gets the whole engine for the reason :func:`zkit_save_16bit_model` does."""


@hookspec
def zkit_engine_close(engine: Engine) -> None:
    """Called once when the engine is closed (``engine.close()``, or at interpreter exit). Free
    files and threads: swap files, I/O pools, monitors. It gets the whole engine because a plugin
    releases here what it attached to it at :func:`zkit_engine_setup`."""


@hookspec
def zkit_report() -> Iterable[tuple[str, str]] | None:
    """Yield ``(topic, text)`` lines for ``zkit report``: versions, whether a backend or
    kernel works on this machine and, when it does not, why."""
