"""Numba-CUDA kernels for zkit: block-sparse attention (SDD, softmax, DSD and their backward) and a
fused multi-tensor Adam/AdamW, with the CUDA simulator as the CPU test path.

Importing this package does not import numba; see :mod:`zkit_cuda_numba.runtime`.
"""

from zkit_cuda_numba.runtime import describe, unavailable_reason

__version__ = "0.1.0"
__all__ = ["describe", "unavailable_reason", "__version__"]
