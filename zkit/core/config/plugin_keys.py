"""Config keys that belong to a separately installed distribution.

When the distribution is installed it registers a :class:`zkit.core.records.ConfigSectionRecord` for
the key and the loader structures the value with that record's schema. When it is not, the value
is accepted only if it asks for nothing (``null``, or an offload ``device`` of ``"none"``), and
anything else is an error naming the distribution to install.

Why a table in the kernel: a plugin that is not installed cannot declare anything, yet a DeepSpeed
config names its keys (``zero_optimization.offload_optimizer``...) and the user should learn
what to install rather than read "unknown key". So this is data for that case only: the
well-known keys of the distributions zkit ships, each with the distribution to name in the error
and the values that are fine without it. Which plugin owns a key at run time comes from the
records: the loader structures a key by whatever installed distribution registered it
(``ConfigSectionRecord.dist`` names it), whether or not that distribution is the one listed here.
A plugin never needs an entry, except to place its section at a key the built-in schema holds a
slot for (the two ``offload_*`` keys of ``zero_optimization``: DeepSpeed's layout), which the
loader otherwise refuses as a built-in key.
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

from zkit.core.config.errors import ConfigError


def _no_offload(value: Any) -> bool:
    return value is None or (
        isinstance(value, dict) and str(value.get("device") or "none").lower() == "none"
    )


def _absent(value: Any) -> bool:
    return value is None


@attrs.frozen(kw_only=True)
class PluginKey:
    """A dotted config path owned by ``dist``; ``inert(value)`` is True for a value that asks
    for nothing and is therefore fine without the distribution."""

    path: str
    dist: str
    inert: Callable[[Any], bool] = _absent


PLUGIN_KEYS: dict[str, PluginKey] = {
    key.path: key
    for key in (
        PluginKey(
            path="zero_optimization.offload_optimizer", dist="zkit-offload", inert=_no_offload
        ),
        PluginKey(path="zero_optimization.offload_param", dist="zkit-offload", inert=_no_offload),
        PluginKey(path="aio", dist="zkit-offload"),
        PluginKey(path="sparse_attention", dist="zkit-sparse"),
        PluginKey(path="pipeline", dist="zkit-pipeline"),
    )
}


def check_without_plugin(path: str, value: Any) -> None:
    """Raise unless ``value`` of the plugin-owned key ``path`` is inert."""
    key = PLUGIN_KEYS[path]
    if key.inert(value):
        return
    detail = ""
    if isinstance(value, dict) and "device" in value:
        detail = f" (device {value['device']!r})"
    import importlib.metadata

    try:
        version = importlib.metadata.version(key.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"config key '{path}'{detail} is provided by the distribution '{key.dist}', "
            f"which is not installed: pip install {key.dist}",
            key=path,
        ) from None
    raise ConfigError(
        f"config key '{path}'{detail} is provided by the distribution '{key.dist}', which is installed "
        f"(version {version}) but registered no '{path}' section: is its plugin blocked, or older than "
        f"this zkit? pip install -U {key.dist}",
        key=path,
    )


def check_blocked_builtin(path: str, plugin: str, value: Any) -> None:
    """Raise unless ``value`` of ``path``, a section of zkit's own plugin ``plugin`` that is blocked,
    is ``null``."""
    if value is None:
        return
    raise ConfigError(
        f"config key '{path}' is provided by zkit's built-in plugin '{plugin}', which is blocked "
        f"(ZKIT_BLOCK_PLUGINS or zkit -p no:{plugin}): unblock it, or remove the key",
        key=path,
    )
