"""Checkpoint a model's blocks by policy, without editing the model, and undo it.

A selected module's class is swapped for a subclass whose ``__call__`` runs the original call
(forward *and* the module's hooks) through a runner: :func:`zkit.activations.recompute.apply`
passes zkit's checkpoint. Parameter names,
``state_dict`` keys and ``isinstance`` checks are unchanged, and hooks that fetch parameters
(ZeRO stage 3) run again when the block is recomputed. :func:`remove` restores the classes.

Policies:

* ``"every"``: every block of the model's block list (its longest ``nn.ModuleList`` or
  ``nn.Sequential``, e.g. ``GPT.blocks``);
* ``"every_k:K"``: blocks ``0, K, 2K, ...`` of that list;
* ``"type:NAME"``: every module whose class is named ``NAME`` (or ``module.path.NAME``);
* a class or tuple of classes: every instance;
* a callable ``(qualified_name, module) -> bool``.

A module inside one already selected is not selected again (its block is recomputed whole).
"""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch import nn

Policy = Union[str, type, tuple, Callable[[str, nn.Module], bool]]
#: ``runner(call, args, kwargs, *, name, **options)`` runs a wrapped block's call, checkpointed
Runner = Callable[..., Any]

_POLICY_FORMS = "'every', 'every_k:K', 'type:ClassName', a module class, or a callable (name, module) -> bool"
_subclasses: dict[type, type] = {}


class CheckpointWrapper:
    """Mixin of the swapped-in classes: ``isinstance(m, CheckpointWrapper)`` tells a wrapped block.
    ``m.checkpoint_options`` holds the keyword options given to :func:`wrap`."""

    checkpoint_options: dict[str, Any]
    checkpoint_name: str
    checkpoint_runner: Runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = super().__call__  # type: ignore[misc]  # nn.Module.__call__: hooks + forward
        return self.checkpoint_runner(call, args, kwargs, name=self.checkpoint_name, **self.checkpoint_options)


def _wrapped_class(cls: type) -> type:
    sub = _subclasses.get(cls)
    if sub is None:
        sub = type(f"Checkpointed{cls.__name__}", (CheckpointWrapper, cls), {"__module__": cls.__module__})
        sub._zkit_original_class = cls  # type: ignore[attr-defined]
        _subclasses[cls] = sub
    return sub


def _block_list(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    best: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks for the policy "
            "'every'/'every_k'; name the blocks with policy='type:ClassName' or a callable"
        )
    prefix, blocks = best
    return prefix, [(f"{prefix}.{i}" if prefix else str(i), m) for i, m in enumerate(blocks)]


def _matcher(model: nn.Module, policy: Policy) -> Callable[[str, nn.Module], bool]:
    if isinstance(policy, str):
        kind, _, arg = policy.partition(":")
        if policy == "every" or kind == "every_k":
            k = 1
            if kind == "every_k":
                if not arg.isdigit() or int(arg) < 1:
                    raise ValueError(f"checkpoint policy {policy!r}: K in 'every_k:K' must be an integer >= 1")
                k = int(arg)
            _, blocks = _block_list(model)
            chosen = {id(m) for i, (_, m) in enumerate(blocks) if i % k == 0}
            return lambda name, module: id(module) in chosen
        if kind == "type" and arg:
            return lambda name, module: arg in (type(module).__name__, f"{type(module).__module__}.{type(module).__qualname__}")
        raise ValueError(f"unknown checkpoint policy {policy!r}; use {_POLICY_FORMS}")
    if isinstance(policy, type) or (isinstance(policy, tuple) and all(isinstance(c, type) for c in policy)):
        return lambda name, module: isinstance(module, policy)
    if callable(policy):
        return lambda name, module: bool(policy(name, module))
    raise TypeError(f"checkpoint policy must be {_POLICY_FORMS}; got {type(policy).__name__}")


def select_blocks(model: nn.Module, policy: Policy) -> list[tuple[str, nn.Module]]:
    """The ``(qualified_name, module)`` pairs ``policy`` selects, outermost only, in model order."""
    match = _matcher(model, policy)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(f"{c}.") for c, _ in chosen):
            continue
        if match(name, module):
            chosen.append((name, module))
    return chosen


def wrap(model: nn.Module, policy: Policy, runner: Runner, **options: Any) -> list[str]:
    """Run the blocks ``policy`` selects through ``runner``; returns their qualified names.

    ``options`` are passed to every ``runner`` call (zkit's checkpoint: ``use_reentrant``,
    ``preserve_rng_state``, ``group``). Raises if the policy selects nothing or a selected block is
    already checkpointed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"zkit.activations.recompute.apply needs an nn.Module, got {type(model).__name__}")
    chosen = select_blocks(model, policy)
    if not chosen:
        raise ValueError(f"checkpoint policy {policy!r} selects no module of {type(model).__name__}")
    for name, module in chosen:
        if isinstance(module, CheckpointWrapper):
            raise ValueError(
                f"module {name!r} is already checkpointed; call zkit.activations.recompute.remove(model) first"
            )
    for name, module in chosen:
        module.__class__ = _wrapped_class(type(module))
        module.checkpoint_options = dict(options)
        module.checkpoint_name = name
        module.checkpoint_runner = runner
    return [name for name, _ in chosen]


def remove(model: nn.Module) -> list[str]:
    """Undo :func:`wrap` on every wrapped module of ``model``; returns their names."""
    undone = []
    for name, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            module.__class__ = type(module)._zkit_original_class  # type: ignore[attr-defined]
            del module.checkpoint_options, module.checkpoint_name, module.checkpoint_runner
            undone.append(name or type(model).__name__)
    return undone


def is_checkpointed(module: torch.nn.Module) -> bool:
    return isinstance(module, CheckpointWrapper)
