"""From a stage's order of compute to its full instruction stream.

Every built-in schedule decides only the *order of compute* on each stage (forwards and backwards of
``(micro_batch, chunk)``); :func:`lower` adds the data loads and transfers around it: a receive just
before the compute that needs it, a send just after the compute that produces it. A send followed
by the next compute's receive are adjacent, so the interpreter posts them as one batch (the
``send_forward_recv_backward`` exchange of 1F1B's steady state).
"""
from __future__ import annotations

from typing import Iterable, Iterator

from zkit_pipeline.schedules.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
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
    is_first_virtual,
    is_last_virtual,
)


class ScheduleError(ValueError):
    """A schedule was asked for something it cannot do, or a stream is inconsistent."""


def check_args(
    name: str, num_stages: int, stage_id: int, micro_batches: int, virtual_stages: int = 1
) -> None:
    """Validate the arguments every schedule factory takes, with messages naming the problem."""
    for label, value, low in (
        ("num_stages", num_stages, 1),
        ("micro_batches", micro_batches, 1),
        ("virtual_stages", virtual_stages, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ScheduleError(f"{name}: {label} must be an int >= {low}, got {value!r}")
    if not isinstance(stage_id, int) or not 0 <= stage_id < num_stages:
        raise ScheduleError(
            f"{name}: stage_id must be in [0, {num_stages}) for {num_stages} stages, got {stage_id!r}"
        )


def lower(
    compute: Iterable[MicroBatchInstruction],
    num_stages: int,
    stage_id: int,
    virtual_stages: int = 1,
    step: bool = True,
) -> Iterator[Instruction]:
    """The instruction stream of ``stage_id`` for its order of ``compute``; with ``step`` the stream
    ends with the gradient reductions and the optimizer step."""
    loaded: set[int] = set()
    p, v, s = num_stages, virtual_stages, stage_id
    for op in compute:
        mb, c = op.micro_batch, op.chunk
        first, last = is_first_virtual(s, c), is_last_virtual(s, c, p, v)
        if isinstance(op, Forward):
            if (first or last) and mb not in loaded:
                loaded.add(mb)
                yield LoadMicroBatch(mb)
            if not first:
                yield RecvActivation(mb, c)
            yield op
            if not last:
                yield SendActivation(mb, c)
        elif isinstance(op, (Backward, BackwardInput)):
            if not last:
                yield RecvGrad(mb, c)
            yield op
            if not first:
                yield SendGrad(mb, c)
        elif isinstance(op, BackwardWeight):
            yield op
        else:
            raise ScheduleError(f"a compute order holds only Forward/Backward instructions, got {op}")
    if step:
        yield ReduceTiedGrads()
        yield ReduceGrads()
        yield OptimizerStep()
