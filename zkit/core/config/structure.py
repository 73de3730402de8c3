"""Strict dict -> attrs structuring, shared by built-in sections and plugin schemas.

Rules: every key must be a field (or an old alias, or a plugin-owned path); a misspelled key is
reported with the closest valid one. Values are type-checked against the field annotations with
JSON semantics (``true`` is not an int; ``5e8`` is an int when the field is an int). ``"auto"``
(a Hugging Face Trainer placeholder) is rejected with an explanation. The only conversions made
are at this edge: integral floats to ints, ints to floats, lists to tuples, and the per-field
``edge`` normalizers.
"""
from __future__ import annotations

import copy
import difflib
import logging
import typing
from typing import Any, Mapping

import attrs

from zkit.core.config.errors import ConfigError, NotImplementedConfigError, auto_error
from zkit.core.config.fields import config_fields, describe, is_section_type, matches, type_options
from zkit.core.config.plugin_keys import check_blocked_builtin, check_without_plugin
from zkit.core.records import ConfigSectionRecord, ProviderRecord


@attrs.define
class Context:
    """What structuring one config needs besides the data: the plugin-owned sections that are
    installed, the keys installed distributions say another distribution provides (path ->
    record), the sections of zkit's own plugins that are blocked (path -> plugin name), and
    (filled in on the way) the plugin sections found, by path."""

    sections: Mapping[str, ConfigSectionRecord]
    providers: Mapping[str, ProviderRecord] = attrs.Factory(dict)
    blocked: Mapping[str, str] = attrs.Factory(dict)
    found: dict[str, Any] = attrs.Factory(dict)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def reject_auto(value: Any, path: str) -> None:
    """Raise if ``"auto"`` occurs anywhere inside a free-form value."""
    if isinstance(value, str) and value == "auto":
        raise auto_error(path)
    if isinstance(value, dict):
        for key, item in value.items():
            reject_auto(item, join(path, str(key)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            reject_auto(item, f"{path}[{index}]")


def structure(cls: type, data: Any, path: str, ctx: Context) -> Any:
    """Build ``cls`` from the dict ``data`` found at the dotted ``path``."""
    if not isinstance(data, dict):
        if not path:
            raise ConfigError(f"the config must be a JSON object, got {data!r}")
        raise ConfigError.at(path, f"must be a JSON object (a section), got {data!r}")
    data = _apply_aliases(cls, data, path)
    rewrite = getattr(cls, "rewrite_legacy", None)
    if rewrite is not None:
        data = rewrite(data, path)
    fields = {f.name: f for f in config_fields(attrs.resolve_types(cls))}
    extra_into: str | None = getattr(cls, "extra_keys_into", None)
    kwargs: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            where = path or "<top level>"
            raise ConfigError(f"config keys must be strings, got {key!r} in '{where}'")
        full = join(path, key)
        if full in ctx.sections:
            schema = ctx.sections[full].schema
            section = None if value is None else structure(schema, value, full, ctx)
            if section is not None:
                ctx.found[full] = section
            if key in fields:
                kwargs[key] = section
        elif full in ctx.providers or (key in fields and fields[key].metadata.get("plugin_slot")):
            check_without_plugin(full, value, ctx.providers.get(full))
        elif full in ctx.blocked:
            check_blocked_builtin(full, ctx.blocked[full], value)
        elif key in fields:
            kwargs[key] = _convert(fields[key], value, full, ctx)
        elif extra_into is not None:
            reject_auto(value, full)
            extras[key] = copy.deepcopy(value)
        else:
            raise _unknown_key(cls, key, path, ctx)
    if extras:
        kwargs[extra_into] = {**kwargs.get(extra_into, {}), **extras}
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in kwargs]
    if missing:
        raise ConfigError.at(join(path, missing[0]), "is required")
    try:
        obj = cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(path) from None
    except (TypeError, ValueError) as exc:  # a plugin schema's own validators
        # attrs' validators put the message first and the attribute and value after it
        detail = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        raise ConfigError(f"config section '{path or '<top level>'}' is invalid: {detail}") from exc
    _check_implemented(obj, path)
    return obj


def unstructure(obj: Any) -> Any:
    """The JSON-able form of a structured value (the inverse of :func:`structure`)."""
    if attrs.has(type(obj)):
        out = {f.name: unstructure(getattr(obj, f.name)) for f in config_fields(type(obj))}
        extra_into = getattr(type(obj), "extra_keys_into", None)
        if extra_into is not None:
            out.update(out.pop(extra_into))
        return out
    if isinstance(obj, (list, tuple)):
        return [unstructure(v) for v in obj]
    if isinstance(obj, dict):
        return {k: unstructure(v) for k, v in obj.items()}
    return obj


# -- helpers --------------------------------------------------------------------------------


def _apply_aliases(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    aliases: dict[str, str] = getattr(cls, "key_aliases", {})
    if not any(old in data for old in aliases):
        return data
    data = dict(data)
    for old, new in aliases.items():
        if old in data:
            if new in data:
                raise ConfigError(
                    f"config keys '{join(path, old)}' and '{join(path, new)}' are both given; "
                    f"'{old}' is the old name of '{new}': keep only '{new}'"
                )
            data[new] = data.pop(old)
    return data


def _convert(field: attrs.Attribute, value: Any, path: str, ctx: Context) -> Any:
    tp = field.type
    options = type_options(tp)
    takes_text = any(o in (str, Any, object) for o in options)
    if isinstance(value, str) and value == "auto" and not takes_text:
        raise auto_error(path)
    edge = field.metadata.get("edge")
    if edge is not None:
        value = edge(value)
    section = next((o for o in options if is_section_type(o)), None)
    if section is not None and isinstance(value, dict):
        return structure(section, value, path, ctx)
    if isinstance(value, dict):
        reject_auto(value, path)
        value = copy.deepcopy(value)
    coerced = _coerce(options, value)
    if not matches(tp, coerced):
        raise ConfigError.at(path, f"must be {describe(tp)}, got {value!r}")
    return coerced


def _coerce(options: tuple[Any, ...], value: Any) -> Any:
    """JSON has one number type: 5e8 may mean an int, 1 may mean a float."""
    if type(value) is float and int in options and float not in options and value.is_integer():
        return int(value)
    if type(value) is int and float in options and int not in options:
        return float(value)
    if isinstance(value, list):
        for option in options:
            if typing.get_origin(option) is tuple:
                item = type_options(typing.get_args(option)[0])
                return tuple(_coerce(item, v) for v in value)
    return value


#: keys already warned about in this process: a key that cannot matter says so once
_WARNED: set[str] = set()
log = logging.getLogger("zkit")


def _warn_no_effect(obj: Any, field: attrs.Attribute, path: str) -> None:
    """A key set to something other than its default that has no effect in zkit's design: one
    warning per process naming the key and why, so nobody believes it changed anything."""
    value = getattr(obj, field.name)
    default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
    full = join(path, field.name)
    if value == default or full in _WARNED:
        return
    _WARNED.add(full)
    log.warning("config key '%s' = %r has no effect in zkit: %s", full, value, field.metadata["hint"])


def _check_implemented(obj: Any, path: str) -> None:
    for f in config_fields(type(obj)):
        if f.metadata.get("hint"):
            _warn_no_effect(obj, f, path)
        rule = f.metadata.get("unimplemented")
        if not rule:
            continue
        value = getattr(obj, f.name)
        requested = rule(value) if callable(rule) else value != f.default
        if requested:
            default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default
            what = f.metadata.get("doc", "").rstrip(".")
            raise NotImplementedConfigError.at(
                join(path, f.name),
                f"is set to {value!r}, but zkit does not implement this feature yet ({what}); "
                f"remove the key or set it to {default!r}",
            )


def _unknown_key(cls: type, key: str, path: str, ctx: Context) -> ConfigError:
    valid = [f.name for f in config_fields(cls)]
    valid += list(getattr(cls, "key_aliases", {}))
    for owned in (*ctx.sections, *ctx.providers, *ctx.blocked):
        parent, _, leaf = owned.rpartition(".")
        if parent == path:
            valid.append(leaf)
    valid = sorted(set(valid))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    full = join(path, key)
    if close:
        return ConfigError(
            f"unknown config key '{full}'; did you mean '{join(path, close[0])}'?", key=full
        )
    where = f"of '{path}'" if path else "at the top level"
    return ConfigError(
        f"unknown config key '{full}'; valid keys {where} are: {', '.join(valid)}", key=full
    )
