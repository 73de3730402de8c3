"""Tensor (intra-layer model) parallelism on the tensor axis of the process grid."""
from __future__ import annotations

from zkit_pipeline.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from zkit_pipeline.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_tensor_parallel,
    normal_init,
)
from zkit_pipeline.tensor_parallel.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from zkit_pipeline.tensor_parallel.module import TensorParallelModule
from zkit_pipeline.tensor_parallel.rng_tracker import (
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_seed,
)

__all__ = [
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "copy_to_group",
    "gather_from_group",
    "get_rng_tracker",
    "mark_tensor_parallel",
    "model_parallel_seed",
    "normal_init",
    "reduce_from_group",
    "scatter_to_group",
    "vocab_parallel_cross_entropy",
]
