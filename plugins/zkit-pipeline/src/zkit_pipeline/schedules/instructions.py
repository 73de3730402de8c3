"""The instruction set of a pipeline schedule.

A schedule is, for each pipeline stage, a stream of these small frozen records; one interpreter
(:mod:`zkit_pipeline.interpreter`) executes any stream and one simulator
(:mod:`zkit_pipeline.simulate`) checks any stream, so a new schedule is only a new ordering.

With interleaving, the model is cut into ``num_stages * virtual_stages`` pieces. Piece ``k`` (the
*virtual stage*) lives on stage ``k % num_stages`` as its local *chunk* ``k // num_stages``; a
stage therefore holds chunks ``0 .. virtual_stages-1``. Activations flow from virtual stage ``k``
to ``k + 1`` and gradients back, so the peer of every transfer follows from ``(stage, chunk)``:
instructions carry no ranks.

Consecutive communication instructions in a stream form one *batch*: the interpreter posts them
together (``batch_isend_irecv``) and waits for all of them, so a schedule writes
``SendActivation, RecvGrad`` to overlap the two directions as one exchange.
"""
from __future__ import annotations

import attrs


def _non_negative(_inst, attribute, value) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative int, got {value!r}")


@attrs.frozen
class Instruction:
    """Base class of every instruction."""

    def __str__(self) -> str:  # compact form for traces and error messages
        fields = ", ".join(str(getattr(self, a.name)) for a in attrs.fields(type(self)))
        return f"{type(self).__name__}({fields})"


@attrs.frozen
class MicroBatchInstruction(Instruction):
    """An instruction about one micro-batch on one local chunk of the stage."""

    micro_batch: int = attrs.field(validator=_non_negative)
    chunk: int = attrs.field(default=0, validator=_non_negative)


# -- data and compute -----------------------------------------------------------------------------


@attrs.frozen
class LoadMicroBatch(MicroBatchInstruction):
    """Take the next micro-batch from the data iterator (inputs on the first stage, labels on the
    last). Micro-batches must be loaded in increasing order."""


@attrs.frozen
class Forward(MicroBatchInstruction):
    """Run the chunk's layers on the micro-batch; keep what backward needs."""


@attrs.frozen
class Backward(MicroBatchInstruction):
    """Full backward of the chunk: gradients for its input and its weights."""


@attrs.frozen
class BackwardInput(MicroBatchInstruction):
    """First half of a split backward (zero-bubble schedules): the gradient of the chunk's input
    only, which the previous stage is waiting for."""


@attrs.frozen
class BackwardWeight(MicroBatchInstruction):
    """Second half of a split backward: the weight gradients, off the critical path."""


# -- point-to-point -------------------------------------------------------------------------------


@attrs.frozen
class CommInstruction(MicroBatchInstruction):
    """A transfer to or from a neighbouring virtual stage. ``chunk`` is this stage's chunk."""


@attrs.frozen
class SendActivation(CommInstruction):
    """Send the chunk's output for the micro-batch to the next virtual stage."""


@attrs.frozen
class RecvActivation(CommInstruction):
    """Receive the chunk's input for the micro-batch from the previous virtual stage."""


@attrs.frozen
class SendGrad(CommInstruction):
    """Send the gradient of the chunk's input to the previous virtual stage."""


@attrs.frozen
class RecvGrad(CommInstruction):
    """Receive the gradient of the chunk's output from the next virtual stage."""


# -- end of batch ---------------------------------------------------------------------------------


@attrs.frozen
class ReduceTiedGrads(Instruction):
    """All-reduce the gradients of tied weights over the stages that share them."""


@attrs.frozen
class ReduceGrads(Instruction):
    """Reduce gradients over the data-parallel group (the partitioner's job)."""


@attrs.frozen
class OptimizerStep(Instruction):
    """Clip, unscale and step (``engine.run_optimizer_step()``)."""


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)


# -- virtual-stage arithmetic ---------------------------------------------------------------------


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    return chunk * num_stages + stage


def next_virtual(stage: int, chunk: int, num_stages: int) -> tuple[int, int]:
    """``(stage, chunk)`` of the virtual stage after ``(stage, chunk)``."""
    k = virtual_stage(stage, chunk, num_stages) + 1
    return k % num_stages, k // num_stages


def prev_virtual(stage: int, chunk: int, num_stages: int) -> tuple[int, int]:
    """``(stage, chunk)`` of the virtual stage before ``(stage, chunk)``."""
    k = virtual_stage(stage, chunk, num_stages) - 1
    return k % num_stages, k // num_stages


def is_first_virtual(stage: int, chunk: int) -> bool:
    return stage == 0 and chunk == 0


def is_last_virtual(stage: int, chunk: int, num_stages: int, virtual_stages: int) -> bool:
    return stage == num_stages - 1 and chunk == virtual_stages - 1


def peer_of(inst: CommInstruction, stage: int, num_stages: int) -> tuple[int, int]:
    """``(peer stage, peer chunk)`` of a transfer issued by ``stage``."""
    if isinstance(inst, (SendActivation, RecvGrad)):
        return next_virtual(stage, inst.chunk, num_stages)
    return prev_virtual(stage, inst.chunk, num_stages)
