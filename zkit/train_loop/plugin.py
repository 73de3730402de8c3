"""The default answers to the ``firstresult`` step hooks: one global batch as plain gradient
accumulation, its forward-only evaluation, the optimizer step of
:func:`zkit.train_loop.optimizer_step.apply_step`, and the partitioner's gradient norm."""
from __future__ import annotations

from collections.abc import Mapping

import torch

import zkit
from zkit.train_loop.optimizer_step import apply_step


def run_micro_batch(engine, batch):
    """Forward one micro-batch in whichever form it comes: a tuple/list of positional inputs, a
    mapping of keyword inputs, or one tensor."""
    if isinstance(batch, Mapping):
        return engine(**batch)
    if isinstance(batch, (tuple, list)):
        return engine(*batch)
    return engine(batch)


def next_micro_batch(engine, data_iter, taken: int, what: str):
    """The next micro-batch of ``data_iter``; one that ran out raises a ``StopIteration`` that says
    so (loops that end an epoch on it still do), not a bare one."""
    try:
        return next(data_iter)
    except StopIteration:
        raise StopIteration(
            f"engine.{what}: data_iter ran out after {taken} of the {engine.gradient_accumulation_steps()} "
            f"micro-batches of a global batch (an empty dataset, or the end of its data)"
        ) from None


@zkit.hookimpl(trylast=True)
def zkit_train_batch(engine, data_iter):
    losses = []
    for taken in range(engine.gradient_accumulation_steps()):
        loss = run_micro_batch(engine, next_micro_batch(engine, data_iter, taken, "train_batch"))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return torch.stack(losses).mean()


@zkit.hookimpl(trylast=True)
def zkit_eval_batch(engine, data_iter):
    was_training = engine.module.training
    engine.eval()
    try:
        with torch.no_grad():
            losses = [run_micro_batch(engine, next_micro_batch(engine, data_iter, taken, "eval_batch")).detach().float()
                      for taken in range(engine.gradient_accumulation_steps())]
    finally:
        engine.train(was_training)
    return torch.stack(losses).mean()


@zkit.hookimpl(trylast=True)
def zkit_optimizer_step(step):
    return apply_step(step)


@zkit.hookimpl(trylast=True)
def zkit_grad_norm(step):
    return step.partitioner.grad_norm()
