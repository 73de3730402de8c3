"""zkit plugin entry point of zkit-pipeline: the schedules as step-scheduler records, and
``engine.train_batch`` for pipeline models."""
from __future__ import annotations

from typing import Any

import zkit
from zkit.core.records import ConfigSectionRecord, SchedulerRecord

from zkit_pipeline import __version__
from zkit_pipeline.schedules import BUILTIN_SCHEDULES

_DESCRIPTIONS = {
    "gpipe": "GPipe: all forwards, then all backwards; bubble (p-1)/m, memory grows with m",
    "1f1b": "1F1B (PipeDream-flush): bubble (p-1)/m with at most p micro-batches in flight",
    "interleaved_1f1b": "interleaved 1F1B with virtual stages: bubble (p-1)/(v*m)",
    "zb_h1": "ZB-H1 zero-bubble: split backward, 1F1B's memory, smaller bubble",
}


@zkit.hookimpl
def zkit_register_schedulers():
    for name, factory in BUILTIN_SCHEDULES.items():
        yield SchedulerRecord(name=name, kind="step", factory=factory, description=_DESCRIPTIONS[name])


@zkit.hookimpl
def zkit_config_sections():
    from zkit_pipeline.config import PipelineSectionConfig

    yield ConfigSectionRecord(path=PipelineSectionConfig.SECTION, schema=PipelineSectionConfig,
                              description="DeepSpeed's pipeline section: loads, and says where each choice is made")


@zkit.hookimpl
def zkit_engine_setup(engine: Any) -> None:
    """The pipeline runner and the grid-wide gradient norm of split models."""
    from zkit_pipeline import engine_api

    engine_api.setup(engine)


@zkit.hookimpl(wrapper=True)
def zkit_grad_norm(step: Any) -> Any:
    """The norm over the whole grid for split models: the data-parallel norm inside, summed over
    the pipeline and tensor ranks, each tensor held whole on several of them counted once."""
    from zkit_pipeline import engine_api

    norm = yield
    grid_norm = step.stash.get(engine_api.GRID_NORM, None)
    return norm if grid_norm is None else grid_norm(norm)


@zkit.hookimpl
def zkit_eval_batch(engine: Any, data_iter: Any) -> Any:
    """Answer ``engine.eval_batch`` when ``engine.module`` is a PipelineModule: forward only
    through the stages, the mean loss on every stage."""
    from zkit_pipeline import engine_api
    from zkit_pipeline.module import PipelineModule

    if not isinstance(getattr(engine, "module", None), PipelineModule):
        return None
    return engine_api.eval_batch(engine, data_iter)


@zkit.hookimpl
def zkit_train_batch(engine: Any, data_iter: Any) -> Any:
    """Answer ``engine.train_batch`` when ``engine.module`` is a PipelineModule: one global batch
    of ``gradient_accumulation_steps`` micro-batches through the module's schedule, the optimizer
    step through the engine's ``zkit_optimizer_step`` hook, and the engine's counters and step log
    advanced as ``engine.step`` would."""
    from zkit_pipeline import engine_api
    from zkit_pipeline.module import PipelineModule

    if not isinstance(getattr(engine, "module", None), PipelineModule):
        return None
    return engine_api.train_batch(engine, data_iter)


@zkit.hookimpl
def zkit_checkpoint_save(engine: Any) -> dict[str, Any] | None:
    """This rank's tensor-parallel RNG states (dropout on split activations), when it has any."""
    from zkit_pipeline.tensor_parallel.rng_tracker import get_rng_tracker

    states = get_rng_tracker().states
    if not states:
        return None
    return {"rng_tracker": {name: cpu for name, (cpu, _) in states.items()}}


@zkit.hookimpl
def zkit_checkpoint_load(engine: Any, state: dict[str, Any]) -> None:
    from zkit_pipeline.tensor_parallel.rng_tracker import get_rng_tracker

    saved = (state or {}).get("rng_tracker")
    if saved:
        tracker = get_rng_tracker()
        for name, cpu in saved.items():
            tracker.states[name] = (cpu, tracker.states.get(name, (None, None))[1])


@zkit.hookimpl
def zkit_report():
    yield "zkit-pipeline", f"{__version__}: schedules {', '.join(BUILTIN_SCHEDULES)}"
