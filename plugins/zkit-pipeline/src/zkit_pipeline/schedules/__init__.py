"""Pipeline schedules: instruction streams for one global batch, one stream per stage.

Each schedule is a function ``factory(num_stages, stage_id, micro_batches, **params)`` returning an
iterable of :mod:`~zkit_pipeline.schedules.instructions`, registered as a ``kind="step"``
:class:`zkit.SchedulerRecord` by :mod:`zkit_pipeline.plugin`. A third-party schedule is a plugin
yielding such a record; :func:`zkit_pipeline.simulate.simulate` checks it before it runs anywhere.
"""
from __future__ import annotations

from zkit_pipeline.schedules.gpipe import forward_only, gpipe
from zkit_pipeline.schedules.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    CommInstruction,
    Forward,
    Instruction,
    LoadMicroBatch,
    MicroBatchInstruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zkit_pipeline.schedules.interleaved import interleaved_1f1b
from zkit_pipeline.schedules.lowering import ScheduleError, lower
from zkit_pipeline.schedules.one_f_one_b import one_f_one_b
from zkit_pipeline.schedules.zero_bubble import zb_h1

#: The built-in schedules by record name.
BUILTIN_SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}

__all__ = [
    "BUILTIN_SCHEDULES",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "CommInstruction",
    "Forward",
    "Instruction",
    "LoadMicroBatch",
    "MicroBatchInstruction",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "one_f_one_b",
    "zb_h1",
]
