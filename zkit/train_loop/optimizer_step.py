"""The optimizer step proper, the built-in answer to ``zkit_optimizer_step``: the global gradient
norm and the overflow check, the fp16 loss scale, clipping, the partitioner's step and the LR
schedule; a batch whose loss or gradients are not finite is skipped, and too many in a row stop
the job naming the cause (DeepSpeed's rules for fp16, ``nonfinite_steps_limit`` for the rest)."""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from zkit.core.stash import StashKey

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

log = logging.getLogger("zkit")

#: consecutive steps skipped for a NaN or infinity (an fp16 overflow with a static scale included)
NONFINITE_IN_A_ROW = StashKey[int]()


def apply_step(engine: "Engine") -> bool:
    """Step the optimizer over this batch's gradients; False when the step was skipped."""
    # The global norm costs a pass over the gradients and an all-reduce: only when fp16 needs
    # its overflow check, clipping needs the norm, or the user asked for it.
    needs_norm = engine.needs_grad_norm()
    norm = float(engine.pm.hook.zkit_grad_norm(engine=engine)) if needs_norm else 0.0
    # Without a norm, the cheap check: the loss and the reduced gradients, on every rank.
    overflow = not math.isfinite(norm) if needs_norm else nonfinite_on_any_rank(engine)
    scaler = engine.loss_scaler
    scale = scaler.scale  # the scale this batch's gradients carry (1.0 unless fp16)
    if scaler.enabled:
        scaler.update(overflow, engine.global_steps + 1)
    if overflow:
        engine.record_step(applied=False)
        engine.partitioner.skip_step()
        _warn_or_stop(engine)
        return False
    engine.stash[NONFINITE_IN_A_ROW] = 0
    true_norm = norm / scale
    factor = 1.0 / scale
    clip = engine.config.gradient_clipping
    if clip > 0 and true_norm > clip:
        factor *= clip / (true_norm + 1e-6)
    engine.record_step(applied=True, grad_norm=true_norm if needs_norm else None)
    engine.partitioner.step(factor)
    engine.partitioner.zero_grad()
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step()
    return True


def nonfinite_on_any_rank(engine: "Engine") -> bool:
    """Whether this batch's loss, or a gradient this rank steps after reduction, was NaN or
    infinite on some rank. While gradients are reduced a 4-byte all-reduce beside them makes
    every rank give the same answer, so all skip together (a NaN one rank's backward made
    reaches only the rank owning that shard at stages 1-3). Without reduction (1-bit
    optimizers' compressed or local steps, which exist to save collectives) a rank cannot know
    the others': its own non-finite loss or gradient stops the job rather than letting the
    replicas' steps differ."""
    # one flag on the device and one read of it: each read waits for the device to drain
    bad = torch.zeros(1, dtype=torch.float32, device=engine.device)
    if engine.batch_losses:
        losses = torch.stack([loss.reshape(()) for loss in engine.batch_losses]).to(engine.device)
        bad += torch.isfinite(losses).all().logical_not().to(torch.float32)
    grads_finite = engine.partitioner.grads_finite()
    if grads_finite is not None:
        bad += grads_finite.logical_not().to(device=engine.device, dtype=torch.float32)
    if engine.world_size == 1:
        return bool(bad.item() > 0)
    if not engine.partitioner.gradient_reduction:
        if bad.item() > 0:
            raise FloatingPointError(
                f"step {engine.global_steps + 1}: the loss or the gradients on rank {engine.rank} are NaN or infinite "
                f"while gradients are not reduced (a 1-bit optimizer's compressed or local step), so the ranks "
                f"cannot skip it together; training stopped"
            )
        return False
    engine.comm.all_reduce(bad, "sum")
    return bool(bad.item() > 0)


def _warn_or_stop(engine: "Engine") -> None:
    """Say why a step was skipped; stop after ``nonfinite_steps_limit`` in a row in bf16/fp32 and
    with a static fp16 loss scale (a dynamic one shrinks until ``min_loss_scale`` stops the job)."""
    step = engine.global_steps + 1
    limit = engine.config.nonfinite_steps_limit
    scaler = engine.loss_scaler
    if scaler.enabled and scaler.dynamic:
        if engine.rank == 0:
            log.warning("step %d: gradient overflow, step skipped; loss scale now %g", step, scaler.scale)
        return
    in_a_row = engine.stash[NONFINITE_IN_A_ROW] = engine.stash.get(NONFINITE_IN_A_ROW, 0) + 1
    if scaler.enabled:
        if in_a_row > limit:
            raise FloatingPointError(
                f"step {step}: fp16 gradients overflowed for {in_a_row} steps in a row with the static loss scale "
                f"{scaler.scale:g} (fp16.loss_scale; nonfinite_steps_limit is {limit}); training stopped. Lower "
                f"fp16.loss_scale, set it to 0 for dynamic loss scaling, or train in bf16"
            )
        if engine.rank == 0:
            log.warning("step %d: gradient overflow, step skipped; loss scale now %g", step, scaler.scale)
        return
    if in_a_row > limit:
        raise FloatingPointError(
            f"step {step}: the loss or the gradients were NaN or infinite for {in_a_row} steps in a row "
            f"(nonfinite_steps_limit is {limit}); training stopped. Lower the learning rate, enable "
            f"gradient_clipping, or look for bad inputs in the batches before step {step}"
        )
    if engine.rank == 0:
        log.warning("step %d: the loss or the gradients are NaN or infinite; step skipped (%d in a row, the job "
                    "stops after %d)", step, in_a_row, limit)
