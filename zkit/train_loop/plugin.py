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


@zkit.hookimpl(trylast=True)
def zkit_train_batch(engine, data_iter):
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        loss = run_micro_batch(engine, next(data_iter))
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
            losses = [run_micro_batch(engine, next(data_iter)).detach().float()
                      for _ in range(engine.gradient_accumulation_steps())]
    finally:
        engine.train(was_training)
    return torch.stack(losses).mean()


@zkit.hookimpl(trylast=True)
def zkit_optimizer_step(engine):
    return apply_step(engine)


@zkit.hookimpl(trylast=True)
def zkit_grad_norm(engine):
    return engine.partitioner.grad_norm()
