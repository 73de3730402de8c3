"""1F1B (PipeDream-flush): after a warm-up of ``p - s - 1`` forwards, stage ``s`` alternates one
forward and one backward, so it never holds more than ``p - s`` micro-batches' activations - a bound
independent of ``m`` - with the same bubble ``(p-1)/m`` as GPipe."""
from __future__ import annotations

from typing import Iterator

from zkit_pipeline.schedules.instructions import Backward, Forward, Instruction, MicroBatchInstruction
from zkit_pipeline.schedules.lowering import check_args, lower


def one_f_one_b_order(num_stages: int, stage_id: int, micro_batches: int) -> list[MicroBatchInstruction]:
    """The compute order of 1F1B on ``stage_id``."""
    warmup = min(num_stages - stage_id - 1, micro_batches)
    order: list[MicroBatchInstruction] = [Forward(i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [Forward(warmup + i), Backward(i)]
    order += [Backward(i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def one_f_one_b(
    num_stages: int, stage_id: int, micro_batches: int, *, step: bool = True
) -> Iterator[Instruction]:
    """1F1B's instruction stream for ``stage_id``."""
    check_args("1f1b", num_stages, stage_id, micro_batches)
    return lower(one_f_one_b_order(num_stages, stage_id, micro_batches), num_stages, stage_id, step=step)
