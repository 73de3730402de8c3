"""Interleaved 1F1B: each stage holds ``v`` non-adjacent chunks of the model (virtual stages), so a
micro-batch crosses the pipeline ``v`` times in pieces ``v`` times smaller and the bubble shrinks to
``(p-1)/(v*m)``, for ``v`` times more point-to-point transfers.

Micro-batches go through the chunks in groups of ``p``: forwards of micro-batches ``0..p-1`` on
chunk 0, then on chunk 1, ..., then micro-batches ``p..2p-1`` on chunk 0, and so on; backwards walk
the chunks in reverse. Every stage follows the same order, which keeps the transfers between any two
stages in the same order on both ends.
"""
from __future__ import annotations

from typing import Iterator

from zkit_pipeline.schedules.instructions import Backward, Forward, Instruction, MicroBatchInstruction
from zkit_pipeline.schedules.lowering import ScheduleError, check_args, lower


def _slot(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """``(micro_batch, chunk)`` of the ``k``-th forward (or backward) on any stage."""
    group, within = divmod(k, p * v)
    chunk = within // p
    if backward:
        chunk = v - 1 - chunk
    return group * p + k % p, chunk


def interleaved_order(
    num_stages: int, stage_id: int, micro_batches: int, virtual_stages: int
) -> list[MicroBatchInstruction]:
    """The compute order of interleaved 1F1B on ``stage_id``."""
    p, v, m = num_stages, virtual_stages, micro_batches
    total = m * v
    if m == p:
        warmup = total  # one group only: there is no steady state to enter early
    else:
        warmup = min((p - stage_id - 1) * 2 + (v - 1) * p, total)
    order: list[MicroBatchInstruction] = [Forward(*_slot(k, p, v, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(Forward(*_slot(warmup + k, p, v, False)))
        order.append(Backward(*_slot(k, p, v, True)))
    order += [Backward(*_slot(k, p, v, True)) for k in range(total - warmup, total)]
    return order


def interleaved_1f1b(
    num_stages: int,
    stage_id: int,
    micro_batches: int,
    *,
    virtual_stages: int = 2,
    step: bool = True,
) -> Iterator[Instruction]:
    """Interleaved 1F1B's instruction stream for ``stage_id`` with ``virtual_stages`` chunks per
    stage. ``micro_batches`` must be a multiple of ``num_stages``."""
    check_args("interleaved_1f1b", num_stages, stage_id, micro_batches, virtual_stages)
    if virtual_stages > 1 and num_stages < 2:
        raise ScheduleError(
            "interleaved_1f1b: virtual_stages > 1 needs num_stages >= 2 (chunks interleave across "
            "stages); use 1f1b on a single stage"
        )
    if micro_batches % num_stages:
        raise ScheduleError(
            f"interleaved_1f1b: micro_batches ({micro_batches}) must be a multiple of num_stages "
            f"({num_stages}); micro-batches go through the chunks in groups of num_stages"
        )
    order = interleaved_order(num_stages, stage_id, micro_batches, virtual_stages)
    return lower(order, num_stages, stage_id, virtual_stages, step=step)
