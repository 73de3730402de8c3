"""``deepspeed.ops.sparse_attention``: DeepSpeed's sparsity layouts, from zkit-sparse (the same
parameters give the same block layouts). DeepSpeed's Triton attention modules
(``SparseSelfAttention``, ``BertSparseSelfAttention``, ``SparseAttentionUtils``) are refused:
zkit-sparse attends through the config's ``sparse_attention`` section instead."""
try:
    from zkit_sparse.layouts import (
        BigBirdSparsityConfig,
        BSLongformerSparsityConfig,
        DenseSparsityConfig,
        FixedSparsityConfig,
        LocalSlidingWindowSparsityConfig,
        SparsityConfig,
        VariableSparsityConfig,
    )
except ImportError as exc:  # pragma: no cover - exercised without zkit-sparse
    raise ImportError(f"deepspeed.ops.sparse_attention needs zkit-sparse (pip install zkit-sparse): {exc}") from exc

from zkit.compat.deepspeed.refused import module_getattr

__getattr__ = module_getattr(__name__)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig"]
