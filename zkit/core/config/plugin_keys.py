"""Config keys that nothing installed registers, but that a distribution provides.

When the distribution is installed it registers a :class:`zkit.core.records.ConfigSectionRecord` for
the key and the loader structures the value with that record's schema. When it is not, an
installed distribution's :class:`zkit.core.records.ProviderRecord` (``kind="config"``) names it:
the value is accepted only if it asks for nothing (the record's ``inert``: ``null``, or an offload
``device`` of ``"none"``), and anything else is an error naming the distribution to install. A
DeepSpeed config names such keys (``zero_optimization.offload_optimizer``...), and the user should
learn what to install rather than read "unknown key"; the kernel itself names no distribution.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any

from zkit.core.config.errors import ConfigError
from zkit.core.records import ProviderRecord


def check_without_plugin(path: str, value: Any, provider: ProviderRecord | None) -> None:
    """Raise unless ``value`` of ``path``, a key no installed plugin registers, asks for nothing;
    the error names the distribution ``provider`` says provides it (a built-in slot for a plugin's
    section that no record names: only ``null`` is accepted)."""
    if provider.inert(value) if provider is not None else value is None:
        return
    detail = ""
    if isinstance(value, dict) and "device" in value:
        detail = f" (device {value['device']!r})"
    if provider is None:
        raise ConfigError(f"config key '{path}'{detail} is filled by a plugin's section, and no installed plugin "
                          f"registers one", key=path)
    dist = provider.provider
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"config key '{path}'{detail} is provided by the distribution '{dist}', "
            f"which is not installed: {provider.install()}",
            key=path,
        ) from None
    raise ConfigError(
        f"config key '{path}'{detail} is provided by the distribution '{dist}', which is installed "
        f"(version {version}) but registered no '{path}' section: is its plugin blocked, or older than "
        f"this zkit? pip install -U {dist}",
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
