"""What a user hands ``zkit.initialize`` beside the config: ``optimizer=`` and ``lr_scheduler=``.

The built-in answers of the hooks ``zkit_client_optimizer`` and ``zkit_client_lr_scheduler``
(:mod:`zkit.optim.plugin`):

* a torch optimizer instance is rebuilt, same class and constructor options, over the
  partitioner's shards, and the client's object then *becomes* the built one (:func:`adopt`), so
  that the object the user holds and every scheduler built on it drive what trains, as
  DeepSpeed steps the client's optimizer itself;
* a callable ``param_groups -> optimizer`` is called with the shards' groups;
* no optimizer at all gives an engine for inference or evaluation (:class:`InferenceOnly`);
* a client LR scheduler built over another optimizer is moved onto the one the engine trains.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from zkit.core.engine import NO_OPTIMIZER  # the engine's own refusal: one text for both
from zkit.core.records import OptimizerRecord


class InferenceOnly(torch.optim.Optimizer):
    """The optimizer of an engine built without one: it holds the parameter groups (schedules,
    checkpoints and logs read them) and refuses to step."""

    def __init__(self, params: Any, **_: Any) -> None:
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:
        raise RuntimeError(NO_OPTIMIZER)


def client_optimizer_record(client: Any) -> OptimizerRecord:
    """The record the partitioner builds over its shards for ``optimizer=`` (see the module)."""
    if client is None:
        # No optimizer anywhere: an engine for inference or evaluation, as DeepSpeed allows.
        return OptimizerRecord(name="none", factory=InferenceOnly, dist="zkit")
    if isinstance(client, torch.optim.Optimizer):
        cls, defaults = type(client), constructor_defaults(client)

        def factory(groups: list[dict[str, Any]], **kw: Any) -> torch.optim.Optimizer:
            return adopt(client, cls(groups, **{**defaults, **kw}))

        name = cls.__name__
    elif callable(client):
        factory = lambda groups, **kw: client(groups)  # noqa: E731
        name = getattr(client, "__name__", "client")
    else:
        raise TypeError(f"optimizer= must be a torch optimizer or a callable, got {client!r}")
    # torch's Adam family keeps Adam's moments: its checkpoints load into any "adam" optimizer
    adam = isinstance(client, (torch.optim.Adam, torch.optim.AdamW))
    return OptimizerRecord(name=f"client:{name}", factory=factory, dist="client",
                           state_format="adam" if adam else None)


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The client optimizer's hyper-parameters that its class's constructor takes: ``defaults``
    may hold more (torch's AdamW keeps Adam's ``decoupled_weight_decay`` there but its
    constructor does not accept it)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def adopt(client: torch.optim.Optimizer, built: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The client's optimizer object becomes ``built`` (the same class and options over the
    partitioner's shards): the object the user holds, and every LR scheduler built on it, drive
    what the engine trains, as DeepSpeed steps the client's optimizer itself. Accelerate, for
    one, keeps a torch scheduler on the client optimizer without handing it to initialize. The
    schedule's current and base learning rates carry over."""
    carry_learning_rates(client, built)
    # a scheduler's wrapper of the bound ``step`` (torch counts optimizer steps through it) stays
    kept = {k: v for k, v in vars(client).items() if k == "step"}
    vars(client).clear()
    vars(client).update(vars(built), **kept)
    return client


def carry_learning_rates(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Group by group, ``source``'s current and base learning rates (``lr``, ``initial_lr``: what a
    schedule has set) onto ``target``."""
    for theirs, mine in zip(source.param_groups, target.param_groups):
        for key in ("lr", "initial_lr"):
            if key in theirs:
                mine[key] = theirs[key]


def client_lr_scheduler(client: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The schedule the engine steps for ``lr_scheduler=``: a callable ``optimizer -> scheduler``
    called with the engine's optimizer, or a scheduler object moved onto it."""
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer)
    return rebind_scheduler(client, optimizer)


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """A client LR scheduler built over the client optimizer, moved onto the optimizer the
    engine trains (zkit rebuilds the client optimizer over its shards, so the scheduler would
    otherwise change the learning rate of an optimizer nobody steps)."""
    old = getattr(scheduler, "optimizer", None)
    if old is None or old is optimizer:
        return scheduler
    if len(old.param_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"lr_scheduler= schedules an optimizer with {len(old.param_groups)} parameter groups, but the engine's "
            f"optimizer has {len(optimizer.param_groups)} (its groups come from model_parameters=); pass the same "
            f"groups as model_parameters, or a callable optimizer -> scheduler"
        )
    carry_learning_rates(old, optimizer)
    scheduler.optimizer = optimizer
    # torch's check for "optimizer.step() overridden / called after the scheduler" looks at the
    # first scheduler step only, for a wrapper the scheduler put on the old optimizer; the engine
    # always steps the optimizer first, so that check is skipped rather than warning wrongly.
    if getattr(scheduler, "_step_count", 0) == 1:
        scheduler._step_count = 2
    return scheduler
