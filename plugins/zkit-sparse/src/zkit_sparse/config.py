"""The ``sparse_attention`` config section, with DeepSpeed's keys.

::

    "sparse_attention": {
        "mode": "fixed",
        "block": 16,
        "different_layout_per_head": true,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": false,
        "num_different_global_patterns": 4
    }

Keys left out take the selected mode's default (the layout class's own default, as in
DeepSpeed). Unlike DeepSpeed, a key the selected mode does not use is an error rather than
silently ignored.
"""
from __future__ import annotations

import inspect
from typing import Any

import attrs

from zkit_sparse.layouts import SparsityConfig
from zkit_sparse.registry import get_layout

#: Keys of the section that are not layout parameters.
_NOT_LAYOUT_KEYS = ("mode", "num_heads")


@attrs.define(kw_only=True)
class SparseAttentionConfig:
    """DeepSpeed's ``sparse_attention`` section. ``None`` means "the mode's default"."""

    mode: str = "fixed"
    block: int | None = None
    different_layout_per_head: bool | None = None
    num_local_blocks: int | None = None
    num_global_blocks: int | None = None
    attention: str | None = None
    horizontal_global_attention: bool | None = None
    num_different_global_patterns: int | None = None
    num_random_blocks: int | None = None
    local_window_blocks: list[int] | None = None
    global_block_indices: list[int] | None = None
    global_block_end_indices: list[int] | None = None
    num_sliding_window_blocks: int | None = None
    #: zkit addition: seed of the random blocks (``variable``, ``bigbird``).
    seed: int | None = None
    #: zkit addition: extra parameters of a third-party layout registered with register_layout.
    params: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.layout_params()  # an unknown mode or a key the mode does not use fails here, at load

    def layout_params(self) -> dict[str, Any]:
        """The parameters set in this section, checked against the selected layout's signature."""
        cls = get_layout(self.mode)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        given = {
            f.name: getattr(self, f.name)
            for f in attrs.fields(type(self))
            if f.name not in _NOT_LAYOUT_KEYS + ("params",) and getattr(self, f.name) is not None
        }
        given.update(self.params)
        unused = sorted(set(given) - accepted)
        if unused:
            raise ValueError(
                f"sparse_attention: {', '.join(unused)} not used by mode {self.mode!r} "
                f"({cls.__name__} takes {', '.join(sorted(accepted - {'num_heads'}))})"
            )
        return given

    def to_sparsity_config(self, num_heads: int) -> SparsityConfig:
        """Build the layout object (``FixedSparsityConfig`` ...) for a layer of ``num_heads``."""
        return get_layout(self.mode)(num_heads=num_heads, **self.layout_params())

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> "SparseAttentionConfig":
        """Structure a plain dict, rejecting unknown keys with the closest valid one."""
        names = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(section) - names)
        if unknown:
            import difflib

            key = unknown[0]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"sparse_attention: unknown key {key!r}{hint}")
        return cls(**section)
