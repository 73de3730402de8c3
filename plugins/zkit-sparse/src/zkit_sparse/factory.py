"""The ``block_sparse`` attention record's factory: build a module from config-style kwargs."""
from __future__ import annotations

from typing import Any

import attrs

from zkit_sparse.attention import SparseSelfAttention
from zkit_sparse.config import SparseAttentionConfig
from zkit_sparse.layouts import SparsityConfig

_MODULE_KEYS = ("key_padding_mask_mode", "attn_mask_mode", "workspace_elems", "save_probs",
                "use_kernels", "backend", "flex_block_size", "flex_kernel_options", "flex_compile")


def make_block_sparse_attention(
    *,
    sparsity_config: SparsityConfig | None = None,
    sparse_attention: SparseAttentionConfig | dict[str, Any] | None = None,
    num_heads: int | None = None,
    head_dim: int | None = None,
    max_seq_length: int = 2048,
    causal: bool = True,
    dropout: float = 0.0,
    **kwargs: Any,
) -> SparseSelfAttention:
    """A :class:`SparseSelfAttention` called like zkit's dense attention.

    Give the layout as ``sparsity_config`` (a ``FixedSparsityConfig`` ...), as ``sparse_attention``
    (the config section, a dict or :class:`SparseAttentionConfig`) or as that section's keys
    directly (``mode="bigbird", block=64, ...``); the last two need ``num_heads``. ``causal``
    defaults to True like the dense attention, so switching ``dense`` <-> ``block_sparse`` keeps
    a decoder causal. ``head_dim`` is part of the geometry every attention factory receives
    (see :mod:`zkit.core.attention`); the block layout does not depend on it.
    """
    if head_dim is not None and (type(head_dim) is not int or head_dim < 1):
        raise ValueError(f"block_sparse attention: head_dim must be a positive int, got {head_dim!r}")
    module_kwargs = {k: kwargs.pop(k) for k in _MODULE_KEYS if k in kwargs}
    if sparsity_config is not None:
        if sparse_attention is not None or kwargs:
            raise ValueError("give the layout once: sparsity_config, or sparse_attention, or its keys")
    else:
        if sparse_attention is not None and kwargs:
            raise ValueError(
                f"give the layout once: sparse_attention or its keys, not both ({sorted(kwargs)})"
            )
        section = sparse_attention if sparse_attention is not None else kwargs
        if isinstance(section, dict):
            section = SparseAttentionConfig.from_dict(section)
        if not attrs.has(type(section)):
            raise TypeError(f"sparse_attention must be a dict or SparseAttentionConfig, got {section!r}")
        if num_heads is None:
            raise ValueError("block_sparse attention built from a sparse_attention config needs num_heads")
        sparsity_config = section.to_sparsity_config(num_heads)
    if num_heads is not None and num_heads != sparsity_config.num_heads:
        raise ValueError(f"num_heads={num_heads} but the sparsity config has {sparsity_config.num_heads}")
    return SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length, causal=causal,
                               dropout=dropout, **module_kwargs)
