"""The optimizer step proper, the built-in answer to ``zkit_optimizer_step``: the global gradient
norm and the overflow check, the fp16 loss scale, clipping, the partitioner's step and the LR
schedule; a batch whose loss or gradients are not finite is skipped, and too many in a row stop
the job naming the cause (DeepSpeed's rules for fp16, ``nonfinite_steps_limit`` for the rest).

In bf16 and fp32 the step never waits for the device: the non-finite verdict and the clipping
coefficient stay tensors, the partitioner skips on the device (torch's fused optimizers take
``found_inf`` and ``grad_scale``), and the verdicts are read together every ``steps_per_print``
steps, when the step line reads the loss anyway: then the skipped steps are warned about, and a
run of more than ``nonfinite_steps_limit`` stops the job naming the step where it crossed the
limit. The LR schedule advances on a skipped step, as with torch's ``GradScaler``. fp16 reads its
verdict every step (the loss scale's update needs it on the host): one wait per step."""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from zkit.core.stash import StashKey

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.step_context import StepContext

log = logging.getLogger("zkit")

#: consecutive steps skipped for a NaN or infinity (an fp16 overflow with a static scale included)
NONFINITE_IN_A_ROW = StashKey[int]()
#: (step, device flag: 1.0 when the step was skipped) of the steps not yet read
UNREAD_VERDICTS = StashKey[list]()


def apply_step(step: "StepContext") -> bool | torch.Tensor:
    """Step the optimizer over this batch's gradients; whether it was applied (a 0-dim bool
    tensor where the step decided on the device)."""
    # The global norm costs a pass over the gradients and an all-reduce: only when fp16 needs
    # its overflow check, clipping needs the norm, or the user asked for it.
    norm = step.grad_norm() if step.needs_grad_norm else None
    if step.loss_scaler.enabled or (step.world_size > 1 and not step.partitioner.gradient_reduction):
        return _step_on_host(step, norm)
    return _step_on_device(step, norm)


def _step_on_device(step: "StepContext", norm: torch.Tensor | float | None) -> torch.Tensor:
    """bf16/fp32: nothing read on the host (see the module docstring)."""
    if norm is not None:
        norm = torch.as_tensor(norm, dtype=torch.float32, device=step.device)
        bad = norm.mul(0).nan_to_num_(1.0)  # 0 * a NaN or an infinity is NaN
    else:
        bad = nonfinite_flag(step)
    factor: float | torch.Tensor = 1.0
    clip = step.config.gradient_clipping
    if clip > 0:  # DeepSpeed's and torch's coefficient, applied where the norm exceeds the limit
        factor = torch.where(norm > clip, clip / (norm + 1e-6), 1.0)
    applied = bad == 0
    step.record(applied=applied, grad_norm=norm)
    step.partitioner.step(factor, found_inf=bad)
    step.partitioner.zero_grad()
    if step.lr_scheduler is not None:
        step.lr_scheduler.step()
    verdicts = step.stash.setdefault(UNREAD_VERDICTS, [])
    verdicts.append((step.number, bad))
    if (step.number) % step.config.steps_per_print == 0:
        read_verdicts(step)
    return applied


def read_verdicts(step: "StepContext") -> None:
    """Read the device's verdicts of the steps since the last read, in one wait: warn about each
    skipped step and stop the job after ``nonfinite_steps_limit`` in a row, as if each had been
    read at its own step."""
    verdicts = step.stash.get(UNREAD_VERDICTS, [])
    if not verdicts:
        return
    flags = torch.stack([bad for _, bad in verdicts]).tolist()
    step.stash[UNREAD_VERDICTS] = []
    for (number, _), bad in zip(verdicts, flags):
        if bad:
            _warn_or_stop(step, number)
        else:
            step.stash[NONFINITE_IN_A_ROW] = 0


def _step_on_host(step: "StepContext", norm: torch.Tensor | float | None) -> bool:
    """fp16 (the loss scale's update needs the verdict) and a step without gradient reduction
    (a 1-bit optimizer's compressed or local step): the verdict is read on the host."""
    read_verdicts(step)
    norm = float(norm) if norm is not None else None
    overflow = not math.isfinite(norm) if norm is not None else nonfinite_on_any_rank(step)
    scaler = step.loss_scaler
    scale = scaler.scale  # the scale this batch's gradients carry (1.0 unless fp16)
    if scaler.enabled:
        scaler.update(overflow, step.number)
    if overflow:
        step.record(applied=False)
        step.partitioner.skip_step()
        _warn_or_stop(step, step.number)
        return False
    step.stash[NONFINITE_IN_A_ROW] = 0
    factor = 1.0 / scale
    clip = step.config.gradient_clipping
    true_norm = norm / scale if norm is not None else None
    if clip > 0 and true_norm is not None and true_norm > clip:
        factor *= clip / (true_norm + 1e-6)
    step.record(applied=True, grad_norm=true_norm)
    step.partitioner.step(factor)
    step.partitioner.zero_grad()
    if step.lr_scheduler is not None:
        step.lr_scheduler.step()
    return True


def nonfinite_flag(step: "StepContext") -> torch.Tensor:
    """1.0 (a 0-dim fp32 tensor on the training device, as torch's fused optimizers take it) when
    this batch's loss, or a gradient some rank steps after reduction, was NaN or infinite, else
    0.0; the same on every rank. While gradients are reduced a 4-byte all-reduce beside them
    makes every rank give the same answer, so all skip together (a NaN one rank's backward made
    reaches only the rank owning that shard at stages 1-3)."""
    bad = _local_flag(step)
    if step.world_size > 1 and step.partitioner.gradient_reduction:
        step.comm.all_reduce(bad, "max")
    return bad


def _local_flag(step: "StepContext") -> torch.Tensor:
    """This rank's part of :func:`nonfinite_flag`: 1.0 when its loss or gradients are bad. A few
    ops whatever the batch (each a kernel launch on a GPU): 0 times the losses' sum is NaN exactly
    when one of them is NaN or infinite (or their sum overflows)."""
    losses = [loss if loss.dim() == 0 else loss.reshape(()) for loss in step.batch_losses]
    zero = None
    if losses:
        total = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        zero = total.to(step.device, torch.float32).mul(0)  # 0.0, or NaN
    grads_finite = step.partitioner.grads_finite()
    if grads_finite is not None:
        grads_finite = grads_finite.to(step.device)
        # divided by False (0), 0 is NaN: bad gradients make the flag NaN as a bad loss does
        zero = grads_finite.logical_not().to(torch.float32) if zero is None else zero.div(grads_finite)
    if zero is None:
        return torch.zeros((), dtype=torch.float32, device=step.device)
    return zero.nan_to_num_(1.0)


def nonfinite_on_any_rank(step: "StepContext") -> bool:
    """:func:`nonfinite_flag`, read on the host. Without reduction (1-bit optimizers' compressed
    or local steps, which exist to save collectives) a rank cannot know the others': its own
    non-finite loss or gradient stops the job rather than letting the replicas' steps differ."""
    if step.world_size > 1 and not step.partitioner.gradient_reduction:
        if _local_flag(step).item() > 0:
            raise FloatingPointError(
                f"step {step.number}: the loss or the gradients on rank {step.rank} are NaN or infinite "
                f"while gradients are not reduced (a 1-bit optimizer's compressed or local step), so the ranks "
                f"cannot skip it together; training stopped"
            )
        return False
    return bool(nonfinite_flag(step).item() > 0)


def _warn_or_stop(step: "StepContext", number: int) -> None:
    """Say why step ``number`` was skipped; stop after ``nonfinite_steps_limit`` in a row in bf16/fp32 and
    with a static fp16 loss scale (a dynamic one shrinks until ``min_loss_scale`` stops the job)."""
    limit = step.config.nonfinite_steps_limit
    scaler = step.loss_scaler
    if scaler.enabled and scaler.dynamic:
        if step.rank == 0:
            log.warning("step %d: gradient overflow, step skipped; loss scale now %g", number, scaler.scale)
        return
    in_a_row = step.stash[NONFINITE_IN_A_ROW] = step.stash.get(NONFINITE_IN_A_ROW, 0) + 1
    if scaler.enabled:
        if in_a_row > limit:
            raise FloatingPointError(
                f"step {number}: fp16 gradients overflowed for {in_a_row} steps in a row with the static loss scale "
                f"{scaler.scale:g} (fp16.loss_scale; nonfinite_steps_limit is {limit}); training stopped. Lower "
                f"fp16.loss_scale, set it to 0 for dynamic loss scaling, or train in bf16"
            )
        if step.rank == 0:
            log.warning("step %d: gradient overflow, step skipped; loss scale now %g", number, scaler.scale)
        return
    if in_a_row > limit:
        raise FloatingPointError(
            f"step {number}: the loss or the gradients were NaN or infinite for {in_a_row} steps in a row "
            f"(nonfinite_steps_limit is {limit}); training stopped. Lower the learning rate, enable "
            f"gradient_clipping, or look for bad inputs in the batches before step {number}"
        )
    if step.rank == 0:
        log.warning("step %d: the loss or the gradients are NaN or infinite; step skipped (%d in a row, the job "
                    "stops after %d)", number, in_a_row, limit)
