"""Block-sparse attention for zkit, with DeepSpeed's layout classes and module.

Porting from DeepSpeed is a change of import::

    from zkit_sparse import SparseSelfAttention, FixedSparsityConfig
"""

from zkit_sparse.attention import SparseSelfAttention, pad_to_block_size
from zkit_sparse.config import SparseAttentionConfig
from zkit_sparse.layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from zkit_sparse.registry import available_layouts, build_sparsity_config, get_layout, register_layout

__version__ = "0.1.0"

__all__ = [
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "available_layouts",
    "build_sparsity_config",
    "get_layout",
    "pad_to_block_size",
    "register_layout",
]
