"""The layout registry: names the ``sparse_attention.mode`` key selects.

Built-in modes are DeepSpeed's (``dense``, ``fixed``, ``variable``, ``bigbird``, ``bslongformer``)
plus ``local``. A third-party layout is a :class:`~zkit_sparse.layouts.SparsityConfig` subclass
registered either in code::

    zkit_sparse.register_layout("dilated", DilatedSparsityConfig)

or by its distribution, found at first use through the entry-point group ``zkit_sparse.layouts``::

    [project.entry-points."zkit_sparse.layouts"]
    dilated = "my_package.layouts:DilatedSparsityConfig"
"""
from __future__ import annotations

import difflib
import importlib.metadata
from typing import Any

from zkit_sparse.layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

ENTRY_POINT_GROUP = "zkit_sparse.layouts"

_BUILTIN: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
    "local": LocalSlidingWindowSparsityConfig,
}
_layouts: dict[str, type[SparsityConfig]] = dict(_BUILTIN)
_entry_points_loaded = False


def register_layout(name: str, cls: type[SparsityConfig], *, replace: bool = False) -> None:
    """Make ``cls`` selectable as ``sparse_attention.mode = name``.

    Registering a name twice is an error unless ``replace=True``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a layout name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, SparsityConfig)):
        raise TypeError(f"layout {name!r} must be a SparsityConfig subclass, got {cls!r}")
    key = name.strip().lower()
    if key in _layouts and _layouts[key] is not cls and not replace:
        raise ValueError(
            f"layout {key!r} is already registered as {_layouts[key].__qualname__}; pass "
            f"replace=True to override it"
        )
    _layouts[key] = cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:
            raise ImportError(f"layout plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
        register_layout(ep.name, cls)


def available_layouts() -> tuple[str, ...]:
    """Every registered layout name, sorted."""
    _load_entry_points()
    return tuple(sorted(_layouts))


def get_layout(name: str) -> type[SparsityConfig]:
    """The layout class registered as ``name`` (case-insensitive)."""
    _load_entry_points()
    key = str(name).strip().lower()
    if key not in _layouts:
        close = difflib.get_close_matches(key, _layouts, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown sparse attention layout {name!r}{hint} (registered: "
            f"{', '.join(sorted(_layouts))})"
        )
    return _layouts[key]


def build_sparsity_config(mode: str, num_heads: int, **params: Any) -> SparsityConfig:
    """``get_layout(mode)(num_heads=num_heads, **params)``, with a clear error for a parameter the
    layout does not take."""
    cls = get_layout(mode)
    try:
        return cls(num_heads=num_heads, **params)
    except TypeError as exc:
        raise TypeError(f"sparse attention layout {mode!r} ({cls.__name__}): {exc}") from exc
