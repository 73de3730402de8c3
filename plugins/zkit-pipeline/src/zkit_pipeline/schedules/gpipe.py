"""GPipe: all forwards, then all backwards. Simple, and it holds every micro-batch's activations at
once (peak memory grows with the number of micro-batches); bubble ``(p-1)/m``."""
from __future__ import annotations

from typing import Iterator

from zkit_pipeline.schedules.instructions import Backward, Forward, Instruction
from zkit_pipeline.schedules.lowering import check_args, lower


def gpipe(
    num_stages: int, stage_id: int, micro_batches: int, *, step: bool = True
) -> Iterator[Instruction]:
    """GPipe's instruction stream for ``stage_id``."""
    check_args("gpipe", num_stages, stage_id, micro_batches)
    compute = [Forward(i) for i in range(micro_batches)] + [Backward(i) for i in range(micro_batches)]
    return lower(compute, num_stages, stage_id, step=step)


def forward_only(
    num_stages: int, stage_id: int, micro_batches: int, *, virtual_stages: int = 1
) -> Iterator[Instruction]:
    """Evaluation: every micro-batch forward through every chunk, no backward, no step."""
    check_args("forward_only", num_stages, stage_id, micro_batches, virtual_stages)
    compute = [Forward(i, c) for i in range(micro_batches) for c in range(virtual_stages)]
    return lower(compute, num_stages, stage_id, virtual_stages, step=False)
