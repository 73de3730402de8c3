"""A checkpoint is taken between optimizer steps, never inside a gradient accumulation.

Gradients accumulated over the first micro-batches of a global batch live in the partitioner's
buffers (partitioned, reduced or not, offloaded, depending on the stage), which a checkpoint does
not hold. A run resumed from a save made there would step its next batch without them. DeepSpeed
lets such a save through and drops them on resume; zkit refuses it, saying where the batch stands.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zkit.core.checkpoint_errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine


def refuse_partial_accumulation(engine: "Engine") -> None:
    """Raise when micro-batches have been back-propagated since the last optimizer step."""
    pending = getattr(engine, "pending_micro_steps", 0)
    if not pending:
        return
    steps = engine.gradient_accumulation_steps()
    raise CheckpointError(
        f"save_checkpoint during gradient accumulation: {pending} of the {steps} micro-batches of step "
        f"{engine.global_steps + 1} (gradient_accumulation_steps {steps}) have been back-propagated and their "
        f"gradients wait for the optimizer step; a checkpoint does not hold them, so a run resumed from it "
        f"would lose them. Save after the engine.step() that ends the batch "
        f"(engine.is_gradient_accumulation_boundary() is True for that micro-batch)"
    )
