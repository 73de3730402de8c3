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
    """Answer ``engine.train_batch`` when ``engine.module`` is a PipelineModule."""
    from zkit_pipeline.module import PipelineModule

    module = getattr(engine, "module", None)
    if not isinstance(module, PipelineModule):
        return None
    runner = getattr(engine, "_zkit_pipeline_runner", None)
    if runner is None:
        from zkit_pipeline.interpreter import PipelineRunner

        name = getattr(module, "schedule", "1f1b")
        record = engine.pm.lookup("scheduler", name) if hasattr(engine, "pm") else None
        factory = record.factory if record is not None else BUILTIN_SCHEDULES[name]
        runner = PipelineRunner(
            module,
            factory,
            engine.config.gradient_accumulation_steps,
            step=engine.apply_step,
            partitioner=getattr(engine, "partitioner", None),
            loss_scale=lambda: float(getattr(engine, "loss_scale", 1.0)),
            comm=getattr(engine, "comm", None),
        )
        engine._zkit_pipeline_runner = runner
    return runner.train_batch(iter(data_iter))


@zkit.hookimpl
def zkit_report():
    yield "zkit-pipeline", f"{__version__}: schedules {', '.join(BUILTIN_SCHEDULES)}"
