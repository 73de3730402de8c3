"""What the plugin adds to a zkit engine whose model is split over a process grid.

* ``engine.train_batch(data_iter)`` of a :class:`PipelineModule` runs its schedule (hook
  ``zkit_train_batch``).
* ``engine.eval_batch(data_iter)`` (DeepSpeed's API) of a :class:`PipelineModule`: forward only
  through the stages, the mean loss of ``gradient_accumulation_steps`` micro-batches on every stage
  (hook ``zkit_eval_batch``; ``zkit_pipeline.eval_batch(engine, data_iter)`` is the same call as a
  function).
* The global gradient norm (clipping, fp16 overflow checks) covers the whole grid, parameters held
  whole on several model-parallel ranks counted once (:mod:`zkit_pipeline.grid_norm`).
* An optimizer that needs whole-parameter norms (LAMB) sums them over the tensor group
  (:mod:`zkit_pipeline.tensor_parallel.optimizer_norms`).
* A pipeline stage frozen whole trains (it runs forward and passes gradients back, holding no
  optimizer state); a split model frozen on every rank is refused on every rank.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from zkit.core.stash import StashKey
from zkit_pipeline.grid_norm import GridNorm, replication_weights
from zkit_pipeline.module import PipelineModule
from zkit_pipeline.tensor_parallel.module import TensorParallelModule

#: the engine's pipeline runner (built at setup: its construction is collective)
RUNNER: StashKey[Any] = StashKey()
#: the engine's grid-wide gradient norm (a model split over pipeline or tensor ranks)
GRID_NORM: StashKey[GridNorm] = StashKey()


def setup(engine: Any) -> None:
    """Called when an engine is built: grid-wide gradient norm, the pipeline runner, and the
    activation checkpointing section applied with the model's tensor-parallel group (the config
    alone turns ``partition_activations`` on, as DeepSpeed's does with its mpu)."""
    module = engine.module
    if isinstance(module, TensorParallelModule) or (isinstance(module, PipelineModule) and module.grid is not None):
        _refuse_if_nothing_trains(engine, module)
        # built before the engine: its tensor and tied groups now talk through the engine's choice
        module.bind_communicators(engine.assembly)
    tensor_group = _tensor_group(module)
    section = engine.config.section("activation_checkpointing")  # None with zkit.activations blocked
    if tensor_group is not None and section is not None and section.partition_activations:
        from zkit.activations import configure

        configure(engine, group=tensor_group)
    tensor_degree = 1 if tensor_group is None else torch.distributed.get_world_size(tensor_group)
    if tensor_degree > 1:
        from zkit_pipeline.tensor_parallel import optimizer_norms

        optimizer_norms.configure(engine, engine.assembly.communicator(tensor_group), tensor_degree)
    if isinstance(module, TensorParallelModule):
        weights = replication_weights(module, module.grid.degree("tensor"), {})
        model = engine.assembly.communicator(module.grid_groups["model"])
        engine.stash[GRID_NORM] = GridNorm(engine.partitioner, weights, model, engine.needs_grad_norm())
    elif isinstance(module, PipelineModule):
        grid = module.grid
        if grid is not None and grid.degree("pipe") * grid.degree("tensor") > 1:
            pipeline = runner(engine)  # collective: every rank builds it at setup, not at its first batch
            weights = replication_weights(module, grid.degree("tensor"), module.tied_copies())
            engine.stash[GRID_NORM] = GridNorm(engine.partitioner, weights, pipeline.comms.get("model"),
                                               engine.needs_grad_norm())


def _refuse_if_nothing_trains(engine: Any, module: Any) -> None:
    """A part of a split model may be frozen whole (a pipeline stage that only passes gradients
    on, as in DeepSpeed), so the partitioner accepts a part without trainable parameters; the
    whole model without any is refused here, on every rank (the count is summed over all)."""
    count = torch.tensor([sum(p.numel() for p in module.parameters() if p.requires_grad)],
                         dtype=torch.float64, device=engine.device)
    torch.distributed.all_reduce(count)
    if count.item() == 0:
        raise ValueError(
            f"the model has no trainable parameters (requires_grad=True) on any of its "
            f"{torch.distributed.get_world_size()} ranks ({type(module).__name__}): nothing to train"
        )


def _tensor_group(module: Any) -> Any:
    """The torch process group of the model's tensor-parallel ranks, or None."""
    if isinstance(module, TensorParallelModule):
        return module.grid_groups["tensor"]
    if isinstance(module, PipelineModule) and module.grid is not None:
        return module.grid_groups["tensor"]
    return None


def runner(engine: Any) -> Any:
    """The engine's :class:`~zkit_pipeline.interpreter.PipelineRunner`, built on first use."""
    existing = engine.stash.get(RUNNER, None)
    if existing is not None:
        return existing
    from zkit_pipeline.interpreter import PipelineRunner

    module = engine.module
    name = module.schedule
    record = engine.pm.lookup("scheduler", name)
    if record.kind != "step":
        raise ValueError(f"PipelineModule: schedule {name!r} is a {record.kind} scheduler, not a pipeline (step) schedule")
    engine.stash[RUNNER] = PipelineRunner(
        module,
        record.factory,
        engine.gradient_accumulation_steps(),
        step=engine.run_optimizer_step,
        partitioner=engine.partitioner,
        micro_step=engine.micro_step_protocol,
        comm=getattr(engine, "world_comm", None),
        assembly=engine.assembly,
    )
    return engine.stash[RUNNER]


def train_batch(engine: Any, data_iter: Iterable[Any]) -> torch.Tensor:
    loss = runner(engine).train_batch(iter(data_iter))
    engine.finish_global_batch(loss)
    return loss


def eval_batch(engine: Any, data_iter: Iterable[Any]) -> torch.Tensor:
    """Evaluate one global batch of a :class:`PipelineModule` engine: ``gradient_accumulation_steps``
    micro-batches ``(inputs, labels)`` from ``data_iter`` forward through the stages in
    ``torch.no_grad()`` and eval mode; returns their mean loss on every stage (broadcast from the
    last stage over the pipe group; each data-parallel replica its own). No gradient, optimizer
    state or step counter changes."""
    if not isinstance(engine.module, PipelineModule):
        raise TypeError(
            f"eval_batch runs a PipelineModule through its stages; this engine's model is a "
            f"{type(engine.module).__name__} (evaluate it with engine(inputs) under torch.no_grad())"
        )
    return runner(engine).eval_batch(iter(data_iter))
