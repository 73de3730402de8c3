"""The ``optimizer=`` and ``lr_scheduler=`` given to ``zkit.initialize`` reach the engine through
the hooks ``zkit_client_optimizer`` and ``zkit_client_lr_scheduler`` (answered by the built-in
``zkit.optim_torch``): a plugin answering them is used, and without an answer the engine says
which hook is missing."""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.core.records import OptimizerRecord

CONFIG = {"train_micro_batch_size_per_gpu": 1}


class OwnOptimizer:
    """A plugin that builds SGD whatever the client gave, and keeps the client's schedule as is."""

    def __init__(self):
        self.clients, self.schedulers = [], []

    @zkit.hookimpl
    def zkit_client_optimizer(self, optimizer):
        self.clients.append(optimizer)
        return OptimizerRecord(name="own_sgd", factory=lambda groups, **kw: torch.optim.SGD(groups, lr=0.5))

    @zkit.hookimpl
    def zkit_client_lr_scheduler(self, lr_scheduler, optimizer):
        self.schedulers.append((lr_scheduler, optimizer))
        return lr_scheduler


class OptimizerOnly:
    """A plugin that answers the optimizer hook only."""

    @zkit.hookimpl
    def zkit_client_optimizer(self, optimizer):
        return OptimizerRecord(name="own_sgd", factory=lambda groups, **kw: torch.optim.SGD(groups, lr=0.5))


def test_a_plugin_answering_the_hooks_builds_the_optimizer_and_keeps_the_schedule():
    model = torch.nn.Linear(4, 2)
    client = torch.optim.Adam(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(client, step_size=1)
    plugin = OwnOptimizer()
    engine, optimizer, _, lr_scheduler = zkit.initialize(
        model=model, optimizer=client, lr_scheduler=schedule, config=CONFIG, stack=zkit.Stack(plugins=[plugin]))
    assert plugin.clients == [client] and plugin.schedulers == [(schedule, optimizer)]
    # an instance's groups, their options included, are what the engine partitions
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == 0.01
    assert type(client) is torch.optim.Adam and client.param_groups[0]["lr"] == 0.01  # not adopted
    assert lr_scheduler is schedule and schedule.optimizer is client  # not moved
    assert not engine.inference_only


def test_a_plugin_answering_without_an_optimizer_leaves_the_engine_inference_only():
    plugin = OwnOptimizer()
    engine, optimizer, _, _ = zkit.initialize(model=torch.nn.Linear(4, 2), config=CONFIG,
                                              stack=zkit.Stack(plugins=[plugin]))
    assert plugin.clients == [None] and engine.inference_only and optimizer is None


def test_without_the_built_in_a_client_optimizer_names_the_hook(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.optim_torch")
    model = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match=r"^zkit.initialize\(optimizer=SGD\): no plugin answers the hook "
                                           r"zkit_client_optimizer \(the built-in zkit.optim_torch provides it: "
                                           r"is it blocked\?\)$"):
        zkit.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    with pytest.raises(RuntimeError, match=r"^zkit.initialize\(optimizer=None\): no plugin answers the hook "
                                           r"zkit_client_optimizer "):
        zkit.initialize(model=model, config=CONFIG)


def test_without_the_built_in_a_client_lr_scheduler_names_the_hook(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.optim_torch")
    model = torch.nn.Linear(4, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"^zkit.initialize\(lr_scheduler=StepLR\): no plugin answers the hook "
                                           r"zkit_client_lr_scheduler \(the built-in zkit.optim_torch provides it: "
                                           r"is it blocked\?\)$"):
        zkit.initialize(model=model, optimizer=client, lr_scheduler=torch.optim.lr_scheduler.StepLR(client, 1),
                        config=CONFIG, stack=zkit.Stack(plugins=[OptimizerOnly()]))
