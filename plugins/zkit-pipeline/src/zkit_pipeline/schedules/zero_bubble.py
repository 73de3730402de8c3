"""ZB-H1, the zero-bubble schedule with 1F1B's memory (Qi et al., "Zero Bubble Pipeline
Parallelism", 2023).

The backward of a chunk is split in two: ``BackwardInput`` (B), the gradient of its input, which the
previous stage waits for, and ``BackwardWeight`` (W), the weight gradients, which nobody waits for.
Stages run B as soon as it can and slot the deferred W's into what would otherwise be bubbles. With
a micro-batch's activations held until its W, each stage keeps at most ``p - s`` micro-batches in
flight, exactly 1F1B's bound; the bubble drops from ``(p-1)(F+B+W)`` to about ``(p-1)(F+B-W)``.

The order is found by list scheduling over all stages with the expected costs of F, B and W (equal
by default; pass the measured ones): each stage, whenever it is free, runs the ready B with the
smallest micro-batch, else the next forward if its input is there and the memory bound allows, else
its oldest pending W.
"""
from __future__ import annotations

import functools
from typing import Iterator

from zkit_pipeline.schedules.instructions import (
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    MicroBatchInstruction,
)
from zkit_pipeline.schedules.lowering import ScheduleError, check_args, lower

INF = float("inf")


@functools.lru_cache(maxsize=64)
def zb_h1_orders(
    num_stages: int, micro_batches: int, cost_f: float = 1.0, cost_b: float = 1.0, cost_w: float = 1.0
) -> tuple[tuple[MicroBatchInstruction, ...], ...]:
    """The compute order of every stage (one list scheduling of the whole pipeline)."""
    p, m = num_stages, micro_batches
    for label, cost in (("cost_f", cost_f), ("cost_b", cost_b), ("cost_w", cost_w)):
        if not cost > 0:
            raise ScheduleError(f"zb_h1: {label} must be > 0, got {cost!r}")
    clock = [0.0] * p
    next_f = [0] * p
    next_b = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    in_flight = [0] * p
    # act_ready[s][i]: when micro-batch i's input is on stage s; grad_ready likewise for B.
    act_ready = [[0.0] * m] + [[INF] * m for _ in range(p - 1)]
    grad_ready = [[INF] * m for _ in range(p)]
    orders: list[list[MicroBatchInstruction]] = [[] for _ in range(p)]
    done = [False] * p

    def act(s: int) -> bool:
        """Run one compute on stage ``s`` at its clock if anything is ready."""
        t, b, f = clock[s], next_b[s], next_f[s]
        if b < m and grad_ready[s][b] <= t:
            orders[s].append(BackwardInput(b))
            clock[s] = t + cost_b
            next_b[s] += 1
            pending_w[s].append(b)
            if s > 0:
                grad_ready[s - 1][b] = clock[s]
        elif f < m and act_ready[s][f] <= t and in_flight[s] < p - s:
            orders[s].append(Forward(f))
            clock[s] = t + cost_f
            next_f[s] += 1
            in_flight[s] += 1
            if s + 1 < p:
                act_ready[s + 1][f] = clock[s]
            else:
                grad_ready[s][f] = clock[s]
        elif pending_w[s]:
            orders[s].append(BackwardWeight(pending_w[s].pop(0)))
            clock[s] = t + cost_w
            in_flight[s] -= 1
        else:
            return False
        return True

    while not all(done):
        t = min(clock[i] for i in range(p) if not done[i])
        now = [i for i in range(p) if not done[i] and clock[i] == t]
        if any(act(s) for s in now):
            continue
        # Nobody at time t can run: each finishes, or waits for its next known arrival or for
        # another stage to move on (anything still unknown is produced after that).
        for s in now:
            if next_b[s] == m:
                done[s] = True
                continue
            b, f = next_b[s], next_f[s]
            known = [x for x in (grad_ready[s][b], act_ready[s][f] if f < m else INF) if t < x < INF]
            later = [clock[i] for i in range(p) if not done[i] and clock[i] > t]
            if not known and not later:
                raise ScheduleError(f"zb_h1: list scheduling stalled on stage {s} (p={p}, m={m})")
            clock[s] = min(known + later)
    return tuple(tuple(o) for o in orders)


def zb_h1(
    num_stages: int,
    stage_id: int,
    micro_batches: int,
    *,
    cost_f: float = 1.0,
    cost_b: float = 1.0,
    cost_w: float = 1.0,
    step: bool = True,
) -> Iterator[Instruction]:
    """ZB-H1's instruction stream for ``stage_id``; ``cost_*`` are the expected relative durations
    of forward, input-gradient and weight-gradient compute."""
    check_args("zb_h1", num_stages, stage_id, micro_batches)
    orders = zb_h1_orders(num_stages, micro_batches, float(cost_f), float(cost_b), float(cost_w))
    return lower(orders[stage_id], num_stages, stage_id, step=step)
