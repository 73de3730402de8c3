"""A :class:`Stack` names one plugin record per family, composing a trainer in Python::

    stack = zkit.Stack(partitioner="zero2", optimizer="adamw")
    engine, *_ = zkit.initialize(model=model, config=cfg, stack=stack)

Each field is a record name (case-insensitive), a record object (a plugin you did not install), or
``None`` (let the config decide). ``a | b`` is ``a`` with ``b``'s choices on top. A stack overrides
the config: ``Stack(partitioner="zero3")`` wins over ``zero_optimization.stage`` (which zkit.zero's
plugin answers from ``zkit_configure``; installed plugins' choices win over the built-ins').
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import attrs

from zkit.core.plugin_manager import BUILTIN_PLUGINS, builtin_implementers, builtin_section_owners
from zkit.core.records import FAMILIES, RECORD_OF_FAMILY, Record

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from zkit.core.config import ZkitConfig
    from zkit.core.plugin_manager import ZkitPluginManager

def _choice(family: str):
    def check(_instance, attribute, value):
        if value is None or isinstance(value, str):
            return
        if not isinstance(value, RECORD_OF_FAMILY[family]):
            raise TypeError(
                f"Stack({attribute.name}=...) takes a {family} name or a "
                f"{RECORD_OF_FAMILY[family].__name__}, got {value!r}"
            )

    return check


@attrs.frozen(kw_only=True)
class Stack:
    partitioner: Any = attrs.field(default=None, validator=_choice("partitioner"))
    communicator: Any = attrs.field(default=None, validator=_choice("communicator"))
    optimizer: Any = attrs.field(default=None, validator=_choice("optimizer"))
    scheduler: Any = attrs.field(default=None, validator=_choice("scheduler"))
    allocator: Any = attrs.field(default=None, validator=_choice("allocator"))
    attention: Any = attrs.field(default=None, validator=_choice("attention"))
    #: extra plugin objects (modules or instances with ``@zkit.hookimpl`` functions) to register.
    plugins: tuple[Any, ...] = attrs.field(default=(), converter=tuple)
    #: why a plugin's ``zkit_configure`` makes these choices (what the config asks for): an error
    #: refusing a user's stack that overrides its allocator says it (not part of what is chosen)
    reason: str = attrs.field(default="", eq=False)

    def __or__(self, other: "Stack") -> "Stack":
        if not isinstance(other, Stack):
            return NotImplemented
        changes = {f: getattr(other, f) for f in FAMILIES if getattr(other, f) is not None}
        return attrs.evolve(self, plugins=self.plugins + other.plugins, **changes)

    def chosen(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FAMILIES if getattr(self, f) is not None}


def merge_plugin_stacks(answers: Iterable[tuple[str, Stack]]) -> Stack:
    """Merge the stacks plugins returned from ``zkit_configure``; two plugins choosing different
    records for one family is an error naming both."""
    merged: dict[str, tuple[str, Any]] = {}
    plugins: list[Any] = []
    for plugin, stack in answers:
        if stack is None:
            continue
        if not isinstance(stack, Stack):
            raise TypeError(f"zkit_configure of plugin {plugin!r} returned {stack!r}, not a zkit.Stack")
        plugins.extend(stack.plugins)
        for family, value in stack.chosen().items():
            if family in merged and _key(merged[family][1]) != _key(value):
                raise ValueError(
                    f"plugins {merged[family][0]!r} and {plugin!r} both choose the {family}: "
                    f"{_key(merged[family][1])!r} vs {_key(value)!r}. Choose one with zkit.Stack({family}=...)."
                )
            merged[family] = (plugin, value)
    return Stack(plugins=tuple(plugins), **{f: v for f, (_, v) in merged.items()})


def _refuse_overridden_allocator(answers: dict[str, Any], from_plugins: Stack, stack: Stack) -> None:
    """A plugin chooses an allocator because the config asks for what only that allocator does
    (the stack's ``reason`` says what): a user stack naming another one would drop that request
    silently, so it is refused, naming both. (The user's stack wins for the other families: an
    optimizer it names is checked against the allocator at initialize.)"""
    if from_plugins.allocator is None or stack.allocator is None:
        return
    if _key(from_plugins.allocator) == _key(stack.allocator):
        return
    plugin, chosen = next((name, s) for name, s in answers.items() if isinstance(s, Stack) and s.allocator is not None)
    raise ValueError(
        f"the config needs allocator {_key(from_plugins.allocator)!r} (chosen by plugin {plugin!r} for what the "
        f"config asks: {chosen.reason or 'it says not what'}), but zkit.Stack(allocator={_key(stack.allocator)!r}) "
        f"chooses another, which would not do it: drop what the config asks for it, or the Stack's allocator"
    )


def _key(value: Any) -> str:
    return value.name if isinstance(value, Record) else str(value).lower()


def config_choice(family: str, config: "ZkitConfig") -> str | None:
    """The record name ``config`` chooses for ``family`` when the stack chooses none (``None``:
    the family is left empty)."""
    if family == "partitioner":
        return None  # chosen by a plugin from its own section (zkit.zero: zero_optimization.stage)
    if family == "optimizer":
        return config.optimizer.type if config.optimizer is not None else None
    if family == "scheduler":
        return config.scheduler.type if config.scheduler is not None else None
    return {"communicator": "torch", "allocator": "flat", "attention": "dense"}[family]


def _no_partitioner() -> str:
    """Why no partitioner is chosen: the built-in plugin that registers partitioners (and chooses
    one from its config section) is blocked, and nothing else chose one."""
    owner = builtin_implementers("zkit_register_partitioners")[0]
    section = min((path for path, name in builtin_section_owners().items() if name == owner), key=len,
                  default="its section")
    return (f"no partitioner is chosen: the config's {section}.stage chooses one through the built-in plugin "
            f"{owner!r}, which is blocked (ZKIT_BLOCK_PLUGINS or zkit -p no:{owner}), and no other plugin chose "
            f"one. Pass zkit.Stack(partitioner=NAME) with a partitioner record's name, or unblock {owner}")


def resolve(stack: Stack, config: "ZkitConfig", pm: "ZkitPluginManager") -> dict[str, Record | None]:
    """The record of every family: the stack's choice, else the config's (else the optimizer's
    own communicator), else the default."""
    out: dict[str, Record | None] = {}
    for family in FAMILIES:
        choice = getattr(stack, family)
        if choice is None:
            choice = config_choice(family, config)
        if choice is None:
            if family == "partitioner":
                raise ValueError(_no_partitioner())
            out[family] = None
        elif isinstance(choice, Record):
            out[family] = choice
        else:
            out[family] = pm.lookup(family, choice)
    optimizer = out["optimizer"]
    if optimizer is not None and optimizer.communicator and stack.communicator is None:
        out["communicator"] = pm.lookup("communicator", optimizer.communicator)  # what it exchanges through
    return out


def configure(
    pm: "ZkitPluginManager", stack: Stack, config: "ZkitConfig", device: "torch.device | None" = None
) -> tuple[Stack, dict[str, Record | None]]:
    """What a config plus a user stack resolve to on ``device`` (the engine's; ``None`` when no
    engine is built): the plugins' ``zkit_configure`` stacks merged under the user's (their
    plugins registered), and the record of every family."""
    answers = pm.call_each_named("zkit_configure", config=config, device=device)
    builtin = {name for name, _ in BUILTIN_PLUGINS}
    # a built-in's choice is a default: an installed plugin's choice for the family wins over it
    from_plugins = merge_plugin_stacks((n, s) for n, s in answers.items() if n in builtin) | merge_plugin_stacks(
        (n, s) for n, s in answers.items() if n not in builtin
    )
    _refuse_overridden_allocator(answers, from_plugins, stack)
    merged = from_plugins | stack
    for plugin in merged.plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin)
    return merged, resolve(merged, config, pm)
