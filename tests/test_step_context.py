"""The optimizer step's hooks get a :class:`zkit.core.step_context.StepContext`, not the engine:
what a step reads, and the one method through which it says what came of it."""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.core.engine import Engine
from zkit.core.step_context import StepContext

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _train_one_step(*plugins):
    engine = zkit.initialize(model=torch.nn.Linear(4, 2), config=CONFIG, stack=zkit.Stack(plugins=list(plugins)))[0]
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    return engine


class Watcher:
    def __init__(self):
        self.steps = []
        self.norm_steps = []

    @zkit.hookimpl(wrapper=True)
    def zkit_optimizer_step(self, step):
        self.steps.append(step)
        return (yield)

    @zkit.hookimpl(wrapper=True)
    def zkit_grad_norm(self, step):
        self.norm_steps.append(step)
        return (yield)


def test_the_step_hooks_get_a_step_context_and_not_the_engine():
    watcher = Watcher()
    engine = _train_one_step(watcher)
    [step], [norm_step] = watcher.steps, watcher.norm_steps
    assert isinstance(step, StepContext) and not isinstance(step, Engine) and norm_step is step
    assert step.number == engine.global_steps == 1 and step.needs_grad_norm  # gradient_clipping asks for it
    assert step.partitioner is engine.partitioner and step.comm is engine.comm and step.stash is engine.stash
    assert len(step.batch_losses) == 1 and engine.was_step_applied()
    assert not hasattr(engine, "record_step")  # the outcome is said through the context alone
    with pytest.raises(AttributeError):
        step.number = 2  # frozen: a step changes the engine through record() only


class Skipper:
    """Answers the step instead of the built-in: skips it, and says so through the context."""

    @zkit.hookimpl
    def zkit_optimizer_step(self, step):
        step.record(applied=False)
        return False


def test_a_step_answered_by_a_plugin_records_its_outcome_through_the_context():
    engine = _train_one_step(Skipper())
    assert engine.skipped_steps == 1 and not engine.was_step_applied() and engine.get_global_grad_norm() is None
    assert engine.global_steps == 1
