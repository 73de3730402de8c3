"""The plugin manager: finds plugins, collects their records, and answers "which record is X?".

* Plugins come from the entry-point group ``zkit`` (``[project.entry-points.zkit]``), after zkit's
  own defaults (:data:`BUILTIN_PLUGINS`), which register through the very same hooks.
* ``ZKIT_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry points; ``ZKIT_PLUGINS=a,b`` then loads just
  the named ones. ``ZKIT_BLOCK_PLUGINS=a,b`` (or ``zkit -p no:a``) blocks plugins by entry-point or
  distribution name.
* ``ZKIT_TRACE=1`` logs every hook call and its results to stderr.
* Two records with one name in one family is an error naming both distributions; an unknown name
  lists the valid ones, and the distribution to install when an installed one's
  :class:`~zkit.core.records.ProviderRecord` names it (the kernel knows no distribution).
"""
from __future__ import annotations

import difflib
import importlib.metadata
import importlib
import os
import sys
from typing import Any, Callable, Iterable

import attrs
import pluggy

from zkit.core import hookspecs
from zkit.core.records import (
    FAMILIES, RECORD_OF_FAMILY, CheckpointFormatRecord, ConfigSectionRecord, ProviderRecord, Record,
)

ENTRY_POINT_GROUP = "zkit"

class PluginError(ValueError):
    """A plugin problem the user must fix: a duplicate or unknown name, a bad hook."""


class ZkitPluginManager(pluggy.PluginManager):
    """pluggy's manager plus record collection. Build one with :func:`get_plugin_manager`."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self._dists: dict[int, str] = {}
        self._records: dict[str, dict[str, Record]] | None = None
        self._sections: dict[str, ConfigSectionRecord] | None = None
        self._formats: dict[str, CheckpointFormatRecord] | None = None
        self._providers: dict[tuple[str, str], ProviderRecord] | None = None

    # -- registration -------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None, dist: str | None = None) -> str | None:
        result = super().register(plugin, name=name)
        if result is not None:
            self._dists[id(plugin)] = dist or _dist_of(plugin)
        self._records = self._sections = self._formats = self._providers = None
        return result

    def load_entrypoints(self, only: Iterable[str] | None = None) -> None:
        """Register every ``zkit`` entry point (or only those named in ``only``)."""
        wanted = set(only) if only is not None else None
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.metadata["name"] if ep.dist is not None else ep.name
            if wanted is not None and ep.name not in wanted and dist not in wanted:
                continue
            if self.is_blocked(ep.name) or self.is_blocked(dist) or self.get_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin names itself
                raise PluginError(
                    f"plugin {ep.name!r} from distribution {dist!r} failed to import: {exc}"
                ) from exc
            self.register(plugin, name=ep.name, dist=f"{dist} {ep.dist.version if ep.dist else ''}".strip())

    def dist_of(self, plugin: Any) -> str:
        return self._dists.get(id(plugin), "?")

    # -- records ------------------------------------------------------------------------------
    def call_per_plugin(
        self, hook_name: str, kwargs_for: Callable[[str], dict[str, Any]] = lambda name: {}
    ) -> Iterable[tuple[Any, list[Any]]]:
        """Call a hook once per plugin that answers it, through pluggy's hook caller (so wrappers,
        tracing and call monitoring see every call), with ``kwargs_for(plugin name)``:
        ``(plugin, results)`` in registration order, built-ins first. Each call leaves out the other
        answering plugins, so each result is known with the plugin that gave it; plugins that only
        wrap the hook wrap every call."""
        impls = getattr(self.hook, hook_name).get_hookimpls()
        answering = [impl.plugin for impl in impls if not (impl.wrapper or impl.hookwrapper)]
        for plugin in answering:
            caller = self.subset_hook_caller(hook_name, remove_plugins=[p for p in answering if p is not plugin])
            yield plugin, caller(**kwargs_for(self.get_name(plugin)))

    def _call_each(self, hook_name: str) -> Iterable[tuple[str, Any]]:
        """Every item the registration hook yields, with the distribution that yielded it."""
        for plugin, results in self.call_per_plugin(hook_name):
            for result in results:
                for item in result or ():
                    yield self.dist_of(plugin), item

    def records(self, family: str) -> dict[str, Record]:
        """``{name: record}`` for one family; aliases map to the same record."""
        if self._records is None:
            self._records = {f: self._collect(f) for f in FAMILIES}
        try:
            return self._records[family]
        except KeyError:
            raise PluginError(f"unknown plugin family {family!r}; families: {', '.join(FAMILIES)}") from None

    def _collect(self, family: str) -> dict[str, Record]:
        hook_name = "zkit_register_attention" if family == "attention" else f"zkit_register_{family}s"
        return self._named(hook_name, family, RECORD_OF_FAMILY[family], lambda r: (r.name, *r.aliases))

    def _named(self, hook_name: str, kind: str, expected: type,
               keys: Callable[[Any], Iterable[str]]) -> dict[str, Any]:
        """``{key: record}`` of what a registration hook yields, each record stamped with its
        distribution: the one place a record of the wrong kind, or two records under one key, is
        refused naming both distributions."""
        found: dict[str, Any] = {}
        for dist, record in self._call_each(hook_name):
            if not isinstance(record, expected):
                raise PluginError(f"{hook_name} of distribution {dist!r} yielded {record!r}; expected a "
                                  f"zkit.core.records.{expected.__name__} ({kind})")
            record = attrs.evolve(record, dist=dist)
            for key in keys(record):
                if key in found and found[key] is not record:
                    raise PluginError(
                        f"two {kind} records are named {key!r}: one from {found[key].dist!r}, one from {dist!r}. "
                        f"Uninstall or block one of them (zkit -p no:NAME, or ZKIT_BLOCK_PLUGINS=NAME)."
                    )
                found[key] = record
        return found

    def lookup(self, family: str, name: str) -> Record:
        """The record called ``name`` in ``family``; an unknown name lists the valid ones."""
        records = self.records(family)
        key = name.strip().lower()
        if key in records:
            return records[key]
        valid = sorted({r.name for r in records.values()})
        msg = f"unknown {family} {name!r}; valid {family} names: {', '.join(valid) or '(none)'}"
        close = difflib.get_close_matches(key, list(records), n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        provider = self.provider(family, key)
        if provider is not None:
            msg += f" {family} {name!r} is provided by the distribution {provider.provider!r}: {provider.install()}"
        raise PluginError(msg)

    def providers(self) -> dict[tuple[str, str], ProviderRecord]:
        """``{(kind, name): record}`` of what the installed distributions say other distributions
        provide (:func:`zkit.core.hookspecs.zkit_register_providers`)."""
        if self._providers is None:
            self._providers = {_provided(r.kind, r.name): r for r in self._named(
                "zkit_register_providers", "provider", ProviderRecord, lambda r: (" ".join(_provided(r.kind, r.name)),)
            ).values()}
        return self._providers

    def provider(self, kind: str, name: str) -> ProviderRecord | None:
        """The record naming the distribution that provides ``name`` of ``kind``, if one is declared."""
        return self.providers().get(_provided(kind, name))

    def config_providers(self) -> dict[str, ProviderRecord]:
        """``{dotted path: record}`` of the config keys installed distributions say another
        distribution provides: what :func:`zkit.core.config.load_config` takes as ``providers``."""
        return {name: rec for (kind, name), rec in self.providers().items() if kind == "config"}

    def config_sections(self) -> dict[str, ConfigSectionRecord]:
        """``{dotted path: record}`` of every config section a plugin owns."""
        if self._sections is None:
            self._sections = self._named("zkit_config_sections", "config section", ConfigSectionRecord,
                                         lambda r: (r.path,))
        return self._sections

    def checkpoint_formats(self) -> dict[str, CheckpointFormatRecord]:
        """``{name: record}`` of every checkpoint format, installed plugins' before the built-ins'
        (the order :mod:`zkit.checkpoint.formats` asks them to recognise a directory)."""
        if self._formats is None:
            found = self._named("zkit_register_checkpoint_formats", "checkpoint format", CheckpointFormatRecord,
                                lambda r: (r.name,))
            builtin = [n for n, r in found.items() if r.dist == "zkit"]
            self._formats = {n: found[n] for n in [*(n for n in found if n not in builtin), *builtin]}
        return self._formats

    # -- per-plugin results (checkpoint state) ------------------------------------------------
    def call_each_named(self, hook_name: str, **kwargs: Any) -> dict[str, Any]:
        """Call a hook and return ``{plugin name: result}`` for non-None results."""
        answers = self.call_per_plugin(hook_name, lambda name: kwargs)
        return {self.get_name(plugin): results[0] for plugin, results in answers if results}

    def call_each_with(self, hook_name: str, per_plugin: dict[str, Any], **kwargs: Any) -> None:
        """Call each implementation of a hook with its own ``state`` from ``per_plugin``."""
        for _ in self.call_per_plugin(hook_name, lambda name: {**kwargs, "state": per_plugin.get(name, {})}):
            pass


def _provided(kind: str, name: str) -> tuple[str, str]:
    """A provided name's key: record names are case-insensitive, config keys are not."""
    return kind, name if kind == "config" else name.strip().lower()


def _dist_of(plugin: Any) -> str:
    module = getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "")
    if isinstance(plugin, type(sys)):
        module = plugin.__name__
    top = (module or "").split(".")[0]
    if top == "zkit":
        return "zkit"
    for dist in importlib.metadata.packages_distributions().get(top, []):
        return dist
    return top or "?"


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


#: zkit's own plugins as (plugin name, module): loaded by name, as installed plugins are, so the
#: kernel imports none of them. They register ``trylast`` where one answer wins, so an installed
#: plugin overrides them; the names are what ``-p no:NAME`` / ``ZKIT_BLOCK_PLUGINS`` block.
BUILTIN_PLUGINS = (
    ("zkit.comm_torch", "zkit.torch_distributed.communicator"),
    ("zkit.alloc_flat", "zkit.zero.device_allocator"),
    ("zkit.optim_torch", "zkit.optim.plugin"),
    ("zkit.lr_schedules", "zkit.lr_schedules.plugin"),
    ("zkit.partitioners", "zkit.zero.plugin"),
    ("zkit.attn_dense", "zkit.models.dense_attention"),
    ("zkit.train_loop", "zkit.train_loop.plugin"),
    ("zkit.checkpoint_formats", "zkit.checkpoint.plugin"),
    ("zkit.monitor", "zkit.monitor.plugin"),
    ("zkit.activations", "zkit.activations.plugin"),
    ("zkit.telemetry", "zkit.telemetry.plugin"),
    ("zkit.host_memory", "zkit.host_memory.plugin"),
    ("zkit.deepspeed_only", "zkit.deepspeed_only.plugin"),
    ("zkit.distributions", "zkit.distributions"),
)


def builtin_config_sections() -> dict[str, ConfigSectionRecord]:
    """``{dotted path: record}`` of the config sections zkit's own plugins own, less those of the
    plugins ``ZKIT_BLOCK_PLUGINS`` blocks: what :func:`zkit.core.config.load_config` structures with
    when it is given no ``sections``."""
    blocked = frozenset(_split(os.environ.get("ZKIT_BLOCK_PLUGINS")))
    return {path: rec for path, (owner, rec) in _builtin_section_table().items() if owner not in blocked}


def builtin_section_owners() -> dict[str, str]:
    """``{dotted path: built-in plugin name}`` of every section zkit's own plugins own, blocked or
    not: so that a key of a blocked built-in is refused naming the plugin to unblock."""
    return {path: owner for path, (owner, _) in _builtin_section_table().items()}


def builtin_config_providers() -> dict[str, ProviderRecord]:
    """``{dotted path: record}`` of the config keys zkit's own plugins say a distribution provides:
    what :func:`zkit.core.config.load_config` checks a key nothing registers against when it is
    given no ``providers``."""
    found = {}
    for name, module in BUILTIN_PLUGINS:
        hook = getattr(importlib.import_module(module), "zkit_register_providers", None)
        for rec in (hook() if hook is not None else ()):
            if rec.kind == "config":
                found[rec.name] = attrs.evolve(rec, dist="zkit")
    return found


def builtin_implementers(hook_name: str) -> list[str]:
    """The names of zkit's own plugins that implement ``hook_name``, blocked or not: what an
    error about a hook nothing answers names to unblock."""
    return [name for name, module in BUILTIN_PLUGINS if hasattr(importlib.import_module(module), hook_name)]


_BUILTIN_SECTIONS: dict[str, tuple[str, ConfigSectionRecord]] = {}


def _builtin_section_table() -> dict[str, tuple[str, ConfigSectionRecord]]:
    if not _BUILTIN_SECTIONS:
        found = {}
        for name, module in BUILTIN_PLUGINS:
            hook = getattr(importlib.import_module(module), "zkit_config_sections", None)
            for rec in (hook() if hook is not None else ()):
                found[rec.path] = (name, attrs.evolve(rec, dist="zkit"))
        _BUILTIN_SECTIONS.update(found)
    return _BUILTIN_SECTIONS


def get_plugin_manager(
    *,
    blocked: Iterable[str] = (),
    autoload: bool | None = None,
    extra_plugins: Iterable[Any] = (),
) -> ZkitPluginManager:
    """A manager with zkit's built-in plugins, the installed entry points and ``extra_plugins``.

    ``blocked`` adds to ``ZKIT_BLOCK_PLUGINS``; ``autoload=None`` follows
    ``ZKIT_DISABLE_PLUGIN_AUTOLOAD``.
    """
    pm = ZkitPluginManager()
    for name in [*_split(os.environ.get("ZKIT_BLOCK_PLUGINS")), *blocked]:
        pm.set_blocked(name)
    for name, module in BUILTIN_PLUGINS:
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module), name=name, dist="zkit")
    if autoload is None:
        autoload = os.environ.get("ZKIT_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    if autoload:
        pm.load_entrypoints()
    elif os.environ.get("ZKIT_PLUGINS"):
        pm.load_entrypoints(only=_split(os.environ["ZKIT_PLUGINS"]))
    for plugin in extra_plugins:
        pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements a hook zkit does not have (misspelled?): {exc}") from exc
    if os.environ.get("ZKIT_TRACE", "") not in ("", "0"):
        pm.trace.root.setwriter(lambda line: sys.stderr.write(f"[zkit trace] {line}"))
        pm.enable_tracing()
    return pm
