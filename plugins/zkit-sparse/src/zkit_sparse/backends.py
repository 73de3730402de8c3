"""Which implementation runs a block-sparse layout: ``flex``, ``numba`` or ``torch``.

* ``flex``: PyTorch's FlexAttention, compiled (:mod:`zkit_sparse.block_attention_flex`).
* ``numba``: the Numba-CUDA kernels of the ``zkit-cuda-numba`` distribution.
* ``torch``: the batched PyTorch path (:mod:`zkit_sparse.block_attention_torch`), any device.

``backend="auto"`` (the default) picks, for CUDA tensors, the backend that was fastest in the
measured GPU table (:mod:`zkit_sparse.backend_table`) at the nearest length and density, among
those that can run the call, and ``torch`` for every other device: FlexAttention has no backward
on the CPU. On one H100 flex was the fastest in every measured case; without it, numba beat
torch at 4096 tokens and torch beat numba at 16384 (docs/plugins/sparse.md has the table).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from zkit_sparse import backend_table

BACKENDS = ("flex", "numba", "torch")
#: The backends ``auto`` may choose for CUDA tensors (the fastest by the measured table).
CUDA_ORDER = ("flex", "numba", "torch")
#: dtypes the flex and numba CUDA kernels take (fp64 runs the torch path)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_backend(backend: str, dropout: float) -> str:
    """``backend`` validated against the module's options (at construction, not at step 1)."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be one of 'auto', {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend == "flex" and dropout > 0.0:
        raise ValueError(
            f"backend='flex' cannot apply dropout={dropout}: FlexAttention has no attention-probability "
            "dropout. Use dropout=0.0, or backend='torch' or 'numba'")
    return backend


@functools.cache  # asked at every call of backend="flex"; the answer holds for the process
def flex_unavailable_reason(device_type: str = "cuda") -> str | None:
    """Why FlexAttention cannot run on ``device_type`` here, or None."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5 has)"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "triton is not installed (compiled FlexAttention generates Triton kernels on CUDA)"
    return None


def numba_unavailable_reason(block: int) -> str | None:
    """Why the Numba-CUDA kernels cannot run a layout of ``block``, or None."""
    try:
        from zkit_cuda_numba import attention as kernels
    except ImportError:
        return "the zkit-cuda-numba distribution is not installed (pip install zkit-cuda-numba)"
    reason = kernels.unavailable_reason()
    if reason is None and block not in kernels.SUPPORTED_BLOCKS:
        reason = f"block size {block} is not one of the kernels' {kernels.SUPPORTED_BLOCKS}"
    return reason


def usable_cuda_backends(dtype: torch.dtype, dropout: float, block: int) -> list[str]:
    """The backends of :data:`CUDA_ORDER` that can run a CUDA call of ``dtype`` here."""
    if dtype not in KERNEL_DTYPES:
        return ["torch"]
    usable = []
    for name in CUDA_ORDER:
        if name == "flex" and (dropout > 0.0 or flex_unavailable_reason()):
            continue
        if name == "numba" and numba_unavailable_reason(block) is not None:
            continue
        usable.append(name)
    return usable


def auto_backend(device_type: str, dtype: torch.dtype, dropout: float, block: int,
                 seq_len: int, density: float) -> str:
    """The backend ``backend="auto"`` runs a call on: on CUDA the fastest usable one of the
    measured row nearest ``seq_len`` tokens and ``density`` (present / all layout blocks)."""
    if device_type != "cuda":
        return "torch"
    return backend_table.fastest(seq_len, density, usable_cuda_backends(dtype, dropout, block))


def describe() -> str:
    """One line for ``zkit report``: what ``auto`` runs on CUDA here, and why not the others."""
    parts = []
    for name in CUDA_ORDER:
        reason = {"flex": flex_unavailable_reason(), "numba": numba_unavailable_reason(64),
                  "torch": None}[name]
        parts.append(f"{name}: {'usable' if reason is None else 'no (' + reason + ')'}")
    gpu = "" if torch.cuda.is_available() else " (no CUDA device here)"
    chosen = ", ".join(f"{auto_backend('cuda', torch.bfloat16, 0.0, 64, r.seq, r.density)} at "
                       f"{r.layout} {r.seq}" for r in backend_table.GPU_TABLE)
    return (f"backend auto for CUDA tensors{gpu} (fastest usable in the measured GPU table): "
            f"{chosen}; torch on the CPU; {'; '.join(parts)}; "
            f"force one with backend='flex' | 'numba' | 'torch'")
