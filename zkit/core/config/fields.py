"""How a config key is declared: :func:`setting` holds its default, range check and
documentation in one place; its type check is derived from the annotation, so a field's type is
written exactly once.

Types understood here (and by :mod:`zkit.core.config.structure`): ``bool``, ``int``, ``float``,
``str``, ``dict`` (free-form, e.g. optimizer params), ``tuple[T, ...]``, attrs classes (nested
sections), ``object`` (a section a plugin structures) and ``X | None``.
"""
from __future__ import annotations

import types
import typing
from typing import Any, Callable, Iterable

import attrs

from zkit.core.config.errors import ConfigError

# -- types ----------------------------------------------------------------------------------


def type_options(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union annotation (``int | None`` -> ``(int, NoneType)``)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def is_section_type(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def matches(tp: Any, value: Any) -> bool:
    """Strict JSON-like type test: ``True`` is not an int, ``1`` is a valid float."""
    for option in type_options(tp):
        if option is Any or option is object:
            return True
        if option is type(None):
            if value is None:
                return True
        elif option is bool:
            if type(value) is bool:
                return True
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif option is str:
            if isinstance(value, str):
                return True
        elif option is dict or typing.get_origin(option) is dict:
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return True
        elif typing.get_origin(option) is tuple:
            (item, *_rest) = typing.get_args(option)
            if isinstance(value, tuple) and all(matches(item, v) for v in value):
                return True
        elif isinstance(option, type) and isinstance(value, option):
            return True
    return False


_NAMES = {
    bool: "a bool (true or false)",
    int: "an int",
    float: "a number",
    str: "a string",
    dict: "a JSON object",
    type(None): "null",
}


def describe(tp: Any) -> str:
    """``int | None`` -> ``"an int or null"``, for error messages and the docs."""
    names = []
    for option in type_options(tp):
        if option in _NAMES:
            names.append(_NAMES[option])
        elif typing.get_origin(option) is dict:
            names.append(_NAMES[dict])
        elif typing.get_origin(option) is tuple:
            item = typing.get_args(option)[0]
            names.append(f"a list of {describe(item).split(' ', 1)[1]}s")
        elif is_section_type(option):
            names.append("a JSON object")
        else:
            names.append("a JSON object")
    return " or ".join(dict.fromkeys(names))


def check_type(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: the value matches the field's annotation."""
    tp = attribute.type
    if isinstance(tp, str):  # a class written with ``from __future__ import annotations``
        tp = attrs.fields_dict(attrs.resolve_types(type(instance)))[attribute.name].type
    if not matches(tp, value):
        raise ConfigError.at(attribute.name, f"must be {describe(tp)}, got {value!r}")


# -- range checks ---------------------------------------------------------------------------

Validator = Callable[[Any, attrs.Attribute, Any], None]


def between(low: float, high: float) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not low <= value <= high:
            raise ConfigError.at(attribute.name, f"must be between {low} and {high}, got {value!r}")

    check.__doc__ = f"between {low} and {high}"
    return check


def at_least(low: float) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not value >= low:
            raise ConfigError.at(attribute.name, f"must be >= {low}, got {value!r}")

    check.__doc__ = f">= {low}"
    return check


def above(low: float) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not value > low:
            raise ConfigError.at(attribute.name, f"must be > {low}, got {value!r}")

    check.__doc__ = f"> {low}"
    return check


def one_of(choices: Iterable[Any]) -> Validator:
    allowed = tuple(choices)

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value not in allowed:
            shown = ", ".join(repr(c) for c in allowed)
            raise ConfigError.at(attribute.name, f"must be one of {shown}, got {value!r}")

    check.__doc__ = "one of " + ", ".join(f"`{c}`" for c in allowed)
    return check


def each(validator: Validator) -> Validator:
    """Apply ``validator`` to every item of a tuple."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        for item in value or ():
            validator(instance, attribute, item)

    check.__doc__ = f"each {validator.__doc__}"
    return check


# -- edge normalizers (run by the loader before the class sees the value) -------------------

_DTYPE_SPELLINGS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}
DTYPE_NAMES = ("fp32", "fp16", "bf16")


def normalize_dtype(value: Any) -> Any:
    """DeepSpeed accepts ``"float32"``, ``"FP16"``, ``"bfloat16"``...; store ``fp32/fp16/bf16``."""
    if isinstance(value, str):
        return _DTYPE_SPELLINGS.get(value.strip().lower(), value)
    return value


def upper(value: Any) -> Any:
    return value.strip().upper() if isinstance(value, str) else value


# -- the field declaration ------------------------------------------------------------------


def setting(
    default: Any = attrs.NOTHING,
    *,
    doc: str,
    check: Validator | list[Validator] | None = None,
    hint: str | None = None,
    unimplemented: bool | Callable[[Any], bool] = False,
    edge: Callable[[Any], Any] | None = None,
    default_doc: str | None = None,
    plugin_slot: bool = False,
) -> Any:
    """Declare one config key.

    * ``default``: the one place the default lives (an ``attrs.Factory`` for mutable or
      computed defaults; ``default_doc`` then says in words what it is).
    * ``check``: range validators on top of the type check derived from the annotation.
    * ``hint``: the key is accepted but has no effect in zkit's design; says why (shown in the
      docs).
    * ``unimplemented``: zkit does not implement the feature yet. ``True``: any non-default
      value is a :class:`NotImplementedConfigError`; a callable decides per value.
    * ``edge``: a normalizer the loader applies to the user's value before validation.
    * ``plugin_slot``: the key holds a plugin's section (DeepSpeed's layout puts zkit-offload's
      offload sections inside ``zero_optimization``): a plugin's record may take it, and without
      one the value must ask for nothing.
    """
    checks = [check] if callable(check) else list(check or [])
    metadata = {
        "doc": doc,
        "hint": hint,
        "unimplemented": unimplemented,
        "edge": edge,
        "default_doc": default_doc,
        "checks": tuple(checks),
        "plugin_slot": plugin_slot,
    }
    return attrs.field(default=default, validator=[check_type, *checks], metadata=metadata)


def internal(default: Any = attrs.NOTHING, **kwargs: Any) -> Any:
    """A field that is not a config key (the raw input, the world size): excluded from
    structuring, ``to_dict``, comparisons and the docs."""
    return attrs.field(default=default, eq=False, repr=False, metadata={"internal": True}, **kwargs)


def config_fields(cls: type) -> tuple[attrs.Attribute, ...]:
    """The fields of a config class that are config keys (no internal fields)."""
    return tuple(f for f in attrs.fields(cls) if not f.metadata.get("internal"))
