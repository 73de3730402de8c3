"""zkit plugin entry point of zkit-sparse: the ``block_sparse`` attention and its config section."""
from __future__ import annotations

import zkit
from zkit.core.records import AttentionRecord, ConfigSectionRecord

from zkit_sparse import backends
from zkit_sparse.config import SparseAttentionConfig
from zkit_sparse.factory import make_block_sparse_attention
from zkit_sparse.registry import available_layouts


@zkit.hookimpl
def zkit_register_attention():
    yield AttentionRecord(
        name="block_sparse",
        factory=make_block_sparse_attention,
        description="block-sparse attention (DeepSpeed layouts); FlexAttention or Numba-CUDA kernels on GPU",
        aliases=("sparse",),
    )


@zkit.hookimpl
def zkit_config_sections():
    yield ConfigSectionRecord(
        path="sparse_attention",
        schema=SparseAttentionConfig,
        description="DeepSpeed's sparse_attention section: the layout of block_sparse attention",
    )


@zkit.hookimpl
def zkit_report():
    try:
        from zkit_cuda_numba import describe
    except ImportError:
        kernels = "CPU/PyTorch path only (install zkit-cuda-numba for the CUDA kernels)"
    else:
        kernels = f"CUDA kernels from zkit-cuda-numba: {describe()}"
    yield "zkit-sparse", f"layouts: {', '.join(available_layouts())}; {kernels}"
    yield "zkit-sparse backend", backends.describe()
