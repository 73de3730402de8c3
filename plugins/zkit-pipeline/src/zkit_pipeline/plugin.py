"""zkit plugin entry point of zkit-pipeline: the schedules as step-scheduler records, and
``engine.train_batch`` for pipeline models."""
from __future__ import annotations

from typing import Any

import zkit
from zkit.records import SchedulerRecord

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
def zkit_train_batch(engine: Any, data_iter: Any) -> Any:
    """Answer ``engine.train_batch`` when ``engine.module`` is a PipelineModule: one global batch
    of ``gradient_accumulation_steps`` micro-batches through the module's schedule, the optimizer
    step through the engine's ``zkit_optimizer_step`` hook, and the engine's counters and step log
    advanced as ``engine.step`` would."""
    from zkit_pipeline.module import PipelineModule

    module = getattr(engine, "module", None)
    if not isinstance(module, PipelineModule):
        return None
    runner = getattr(engine, "_zkit_pipeline_runner", None)
    if runner is None:
        runner = _runner_for(engine, module)
        engine._zkit_pipeline_runner = runner
    loss = runner.train_batch(iter(data_iter))
    engine.finish_global_batch(loss)
    return loss


def _runner_for(engine: Any, module: Any) -> Any:
    from zkit_pipeline.interpreter import PipelineRunner

    name = module.schedule
    record = engine.pm.lookup("scheduler", name)
    if record.kind != "step":
        raise ValueError(f"PipelineModule: schedule {name!r} is a {record.kind} scheduler, not a pipeline (step) schedule")

    return PipelineRunner(
        module,
        record.factory,
        engine.gradient_accumulation_steps(),
        step=engine.run_optimizer_step,
        partitioner=engine.partitioner,
        loss_scale=lambda: float(engine.loss_scale),
        comm=getattr(engine, "world_comm", None),
    )


@zkit.hookimpl
def zkit_report():
    yield "zkit-pipeline", f"{__version__}: schedules {', '.join(BUILTIN_SCHEDULES)}"
