"""``deepspeed.ops.sparse_attention``: DeepSpeed's sparsity layouts, from zkit-sparse (the same
parameters give the same block layouts). DeepSpeed's Triton attention modules
(``SparseSelfAttention``, ``BertSparseSelfAttention``, ``SparseAttentionUtils``) are refused:
zkit-sparse attends through the config's ``sparse_attention`` section instead."""
from deepspeed.refused import module_getattr
from zkit_deepspeed.optional import import_plugin

_layouts = import_plugin("zkit_sparse.layouts", "deepspeed.ops.sparse_attention")
BigBirdSparsityConfig = _layouts.BigBirdSparsityConfig
BSLongformerSparsityConfig = _layouts.BSLongformerSparsityConfig
DenseSparsityConfig = _layouts.DenseSparsityConfig
FixedSparsityConfig = _layouts.FixedSparsityConfig
LocalSlidingWindowSparsityConfig = _layouts.LocalSlidingWindowSparsityConfig
SparsityConfig = _layouts.SparsityConfig
VariableSparsityConfig = _layouts.VariableSparsityConfig

__getattr__ = module_getattr(__name__)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig"]
