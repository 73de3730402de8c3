"""Run every stage's instruction stream without processes: prove it deadlock-free and correct, and
time it under given costs.

The model of execution is the interpreter's: compute instructions run in order on their stage;
consecutive transfers form a batch that is posted at once; the stage then waits for the batch's
receives, while its sends complete in the background (the interpreter waits for them at the end of
the batch). Between two stages each direction is one ordered channel, so the
``k``-th send from ``a`` to ``b`` must be the ``k``-th receive on ``b`` from ``a`` and carry what
that receive expects (NCCL and gloo both match point-to-point messages in order). A receive
completes once the matching send is posted (no buffering is assumed).

:func:`simulate` raises :class:`~zkit_pipeline.schedules.ScheduleError` naming the stage and the
instruction on a deadlock, a mismatched transfer, a micro-batch computed twice or never, or compute
run before its input is there; otherwise it returns the timeline with the bubble and the peak number
of micro-batches whose activations are held.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import attrs

from zkit_pipeline.schedules.instructions import (
    COMPUTE,
    RECVS,
    SENDS,
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
    SendActivation,
    is_first_virtual,
    is_last_virtual,
    peer_of,
)
from zkit_pipeline.schedules.lowering import ScheduleError

#: Relative costs of a 1F1B-style model: backward twice the forward, its two halves equal.
DEFAULT_COSTS: Mapping[type, float] = {
    Forward: 1.0,
    Backward: 2.0,
    BackwardInput: 1.0,
    BackwardWeight: 1.0,
}


@attrs.frozen
class SimulationResult:
    """Timeline of one global batch. ``timeline[s]`` lists ``(start, end, instruction)``."""

    makespan: float
    busy: tuple[float, ...]
    finish: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    timeline: tuple[tuple[tuple[float, float, Instruction], ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per stage: time within the makespan spent not computing."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time, summed over stages: ``(p-1)/m`` for GPipe and 1F1B,
        ``(p-1)/(v*m)`` for interleaved 1F1B."""
        return sum(self.idle) / sum(self.busy) if sum(self.busy) else 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of all stages' time spent idle: ``(p-1)/(m+p-1)`` for 1F1B."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0


def _kind(inst: CommInstruction) -> str:
    return "activation" if isinstance(inst, (SendActivation, RecvActivation)) else "gradient"


class _Stage:
    """Execution state of one stage's stream."""

    def __init__(self, index: int, stream: Sequence[Instruction]) -> None:
        self.index = index
        self.stream = list(stream)
        self.pos = 0
        self.clock = 0.0
        self.busy = 0.0
        self.group: list[tuple[tuple[int, int], int, bool, float]] | None = None
        self.timeline: list[tuple[float, float, Instruction]] = []
        self.done: dict[type, set[tuple[int, int]]] = defaultdict(set)
        self.loaded: list[int] = []
        self.in_flight = 0
        self.peak = 0
        self.stepped = False

    def where(self, pos: int | None = None) -> str:
        pos = self.pos if pos is None else pos
        inst = self.stream[pos] if pos < len(self.stream) else "end of stream"
        return f"stage {self.index}, instruction {pos} ({inst})"


def simulate(
    streams: Sequence[Sequence[Instruction]],
    micro_batches: int,
    virtual_stages: int = 1,
    *,
    costs: Mapping[type, float] | None = None,
    p2p_cost: float = 0.0,
    train: bool = True,
    blocking_sends: bool = False,
) -> SimulationResult:
    """Execute ``streams[s]`` for every stage ``s``; see the module docstring.

    ``costs`` maps instruction types to durations (others take no time); a receive completes
    ``p2p_cost`` after both ends posted it. With ``blocking_sends`` a send also holds its stage
    until the receiver posts the matching receive (the strictest transport)."""
    p, v, m = len(streams), virtual_stages, micro_batches
    if p < 1:
        raise ScheduleError("simulate needs at least one stage's stream")
    cost_of = dict(DEFAULT_COSTS if costs is None else costs)
    stages = [_Stage(s, stream) for s, stream in enumerate(streams)]
    # channel (src, dst) -> posted sends / receives: (payload, post time, stage position)
    sends: dict[tuple[int, int], list[tuple[tuple, float, str]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[tuple, float, str]]] = defaultdict(list)

    def post(st: _Stage, pos: int, inst: CommInstruction) -> tuple[tuple[int, int], int, bool, float]:
        peer, peer_chunk = peer_of(inst, st.index, p)
        if not 0 <= inst.chunk < v or not 0 <= inst.micro_batch < m:
            raise ScheduleError(f"{st.where(pos)}: micro-batch or chunk out of range (m={m}, v={v})")
        if isinstance(inst, SENDS):
            need = Forward if isinstance(inst, SendActivation) else (Backward, BackwardInput)
            needs = need if isinstance(need, tuple) else (need,)
            if not any((inst.micro_batch, inst.chunk) in st.done[t] for t in needs):
                raise ScheduleError(f"{st.where(pos)}: sends a result it has not computed yet")
            channel, mine, other = (st.index, peer), sends, recvs
            payload = (_kind(inst), inst.micro_batch, peer_chunk)
        else:
            channel, mine, other = (peer, st.index), recvs, sends
            payload = (_kind(inst), inst.micro_batch, inst.chunk)
        k = len(mine[channel])
        mine[channel].append((payload, st.clock, st.where(pos)))
        if k < len(other[channel]) and other[channel][k][0] != payload:
            a, b = (mine, other) if mine is sends else (other, mine)
            raise ScheduleError(
                f"transfer {k} from stage {channel[0]} to stage {channel[1]} does not match: "
                f"{a[channel][k][2]} sends {a[channel][k][0][0]} (micro-batch {a[channel][k][0][1]}, "
                f"chunk {a[channel][k][0][2]}) but {b[channel][k][2]} receives {b[channel][k][0][0]} "
                f"(micro-batch {b[channel][k][0][1]}, chunk {b[channel][k][0][2]})"
            )
        return channel, k, isinstance(inst, SENDS), st.clock

    def run_compute(st: _Stage, inst: Instruction) -> None:
        pos = st.pos
        if isinstance(inst, MicroBatchInstruction) and (
            not 0 <= inst.chunk < v or not 0 <= inst.micro_batch < m
        ):
            raise ScheduleError(f"{st.where(pos)}: micro-batch or chunk out of range (m={m}, v={v})")
        if st.stepped:
            raise ScheduleError(f"{st.where(pos)}: comes after OptimizerStep")
        key = (getattr(inst, "micro_batch", -1), getattr(inst, "chunk", -1))
        mb, c = key
        first, last = is_first_virtual(st.index, c), is_last_virtual(st.index, c, p, v)
        if isinstance(inst, LoadMicroBatch):
            expected = len(st.loaded)
            if mb != expected:
                raise ScheduleError(f"{st.where(pos)}: loads micro-batch {mb}; the next one is {expected}")
            st.loaded.append(mb)
        elif isinstance(inst, Forward):
            if (first or last) and mb not in st.loaded:
                raise ScheduleError(f"{st.where(pos)}: runs before LoadMicroBatch({mb})")
            if not first and key not in st.done[RecvActivation]:
                raise ScheduleError(f"{st.where(pos)}: runs before its input was received")
        elif isinstance(inst, (Backward, BackwardInput)):
            if key not in st.done[Forward]:
                raise ScheduleError(f"{st.where(pos)}: runs before the forward of that micro-batch")
            if not last and key not in st.done[RecvGrad]:
                raise ScheduleError(f"{st.where(pos)}: runs before its output gradient was received")
        elif isinstance(inst, BackwardWeight):
            if key not in st.done[BackwardInput]:
                raise ScheduleError(f"{st.where(pos)}: runs before BackwardInput of that micro-batch")
        elif isinstance(inst, OptimizerStep):
            if train and ReduceGrads not in st.done:
                raise ScheduleError(f"{st.where(pos)}: OptimizerStep before ReduceGrads")
            st.stepped = True
        if isinstance(inst, COMPUTE) or isinstance(inst, LoadMicroBatch):
            kind = type(inst)
            if key in st.done[kind]:
                raise ScheduleError(f"{st.where(pos)}: micro-batch {mb} chunk {c} runs {kind.__name__} twice")
            if kind is Backward and key in st.done[BackwardInput] or (
                kind is BackwardInput and key in st.done[Backward]
            ):
                raise ScheduleError(f"{st.where(pos)}: mixes Backward and BackwardInput for one micro-batch")
        st.done[type(inst)].add(key)
        if isinstance(inst, Forward):
            st.in_flight += 1
            st.peak = max(st.peak, st.in_flight)
        elif isinstance(inst, (Backward, BackwardWeight)):
            st.in_flight -= 1
        cost = float(cost_of.get(type(inst), 0.0))
        st.timeline.append((st.clock, st.clock + cost, inst))
        st.clock += cost
        st.busy += cost
        st.pos += 1

    def advance(st: _Stage) -> bool:
        """Run ``st`` as far as it can; whether it moved."""
        moved = False
        while True:
            if st.group is not None:
                partner_times = []
                for channel, k, is_send, _ in st.group:
                    if is_send and not blocking_sends:
                        continue  # posted and forgotten; waited for at the end of the batch
                    other = recvs if is_send else sends
                    if k >= len(other[channel]):
                        return moved
                    partner_times.append(other[channel][k][1])
                end = max([st.clock, *partner_times]) + p2p_cost
                for inst in st.stream[st.pos : st.pos + len(st.group)]:
                    st.timeline.append((st.clock, end, inst))
                    if isinstance(inst, RECVS):
                        st.done[type(inst)].add((inst.micro_batch, inst.chunk))
                st.pos += len(st.group)
                st.clock, st.group, moved = end, None, True
                continue
            if st.pos == len(st.stream):
                return moved
            inst = st.stream[st.pos]
            if isinstance(inst, CommInstruction):
                group, pos = [], st.pos
                while pos < len(st.stream) and isinstance(st.stream[pos], CommInstruction):
                    group.append(post(st, pos, st.stream[pos]))
                    pos += 1
                st.group = group
            else:
                run_compute(st, inst)
            moved = True

    while any(st.pos < len(st.stream) for st in stages):
        if not any([advance(st) for st in stages]):
            waiting = "; ".join(
                f"{st.where(_blocked_at(st, sends, recvs, blocking_sends))} waits"
                for st in stages
                if st.pos < len(st.stream)
            )
            raise ScheduleError(f"deadlock: {waiting}")

    for st in stages:
        _check_complete(st, p, v, m, train)
    for channel in set(sends) | set(recvs):
        if len(sends[channel]) != len(recvs[channel]):  # pragma: no cover - caught as deadlock
            raise ScheduleError(f"channel {channel}: {len(sends[channel])} sends, {len(recvs[channel])} receives")
    return SimulationResult(
        makespan=max(st.clock for st in stages),
        busy=tuple(st.busy for st in stages),
        finish=tuple(st.clock for st in stages),
        peak_in_flight=tuple(st.peak for st in stages),
        timeline=tuple(tuple(st.timeline) for st in stages),
    )


def _blocked_at(st: _Stage, sends, recvs, blocking_sends: bool) -> int:
    """Position of the first transfer of the stage's posted batch still without a partner."""
    for i, (channel, k, is_send, _) in enumerate(st.group or ()):
        if is_send and not blocking_sends:
            continue
        if k >= len((recvs if is_send else sends)[channel]):
            return st.pos + i
    return st.pos


def _check_complete(st: _Stage, p: int, v: int, m: int, train: bool) -> None:
    """Every micro-batch forwarded (and, when training, backwarded) exactly once per chunk."""
    want = {(mb, c) for mb in range(m) for c in range(v)}
    missing = want - st.done[Forward]
    if missing:
        raise ScheduleError(f"stage {st.index} never runs Forward for (micro-batch, chunk) {sorted(missing)[:5]}")
    if not train:
        return
    full, split_b, split_w = st.done[Backward], st.done[BackwardInput], st.done[BackwardWeight]
    missing = want - (full | split_b)
    if missing:
        raise ScheduleError(f"stage {st.index} never runs a backward for (micro-batch, chunk) {sorted(missing)[:5]}")
    if split_b != split_w:
        raise ScheduleError(
            f"stage {st.index}: BackwardInput without BackwardWeight (or the reverse) for "
            f"{sorted(split_b ^ split_w)[:5]}"
        )
    if not st.stepped:
        raise ScheduleError(f"stage {st.index}: the stream does not end with OptimizerStep")
