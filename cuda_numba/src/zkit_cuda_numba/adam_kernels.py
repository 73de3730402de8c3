"""Numba-CUDA kernels of the fused multi-tensor Adam/AdamW step.

All parameters of the optimizer live in flat buffers; a chunk table (start, end, param group of
each chunk of at most ``CHUNK`` elements) lets one launch update every parameter of every group,
each thread block taking chunks grid-stride. Per-group hyper-parameters are small device arrays.

``check_finite`` is the fused inf/NaN check of the (still scaled) gradients; ``adam_step`` reads
its flag on the device and does nothing when it is set, so a skipped fp16 step needs no host
round trip before the launch. The gradient is multiplied by ``inv_scale`` as it is loaded (the
loss scale's inverse, times the clipping coefficient when the engine clips), the fp32 master,
``exp_avg`` and ``exp_avg_sq`` are updated in place and, when ``write_half`` is set, the new value
is also written to the 16-bit model copy.

This module imports numba: import it lazily.
"""
from __future__ import annotations

import math

from numba import cuda, float32

CHUNK = 1 << 16


@cuda.jit
def check_finite(grad, chunk_start, chunk_end, found_inf):
    """found_inf[0] <- 1 if any gradient element of a chunk is inf or NaN. Only the chunks are
    read: a buffer the optimizer steps in place may hold elements between parameters (ZeRO's
    alignment padding) that belong to no parameter."""
    tid = cuda.threadIdx.x
    for c in range(cuda.blockIdx.x, chunk_start.shape[0], cuda.gridDim.x):
        for i in range(chunk_start[c] + tid, chunk_end[c], cuda.blockDim.x):
            g = float32(grad[i])
            if math.isinf(g) or math.isnan(g):
                found_inf[0] = 1


@cuda.jit
def adam_step(master, grad, exp_avg, exp_avg_sq, half, write_half, chunk_start, chunk_end,
              chunk_group, lr, beta1, beta2, eps, weight_decay, bias_corr1, bias_corr2,
              decoupled, inv_scale, found_inf):
    """One Adam (``decoupled=0``) or AdamW (``decoupled=1``) step over every chunk."""
    if found_inf[0] != 0:
        return
    tid = cuda.threadIdx.x
    for c in range(cuda.blockIdx.x, chunk_start.shape[0], cuda.gridDim.x):
        grp = chunk_group[c]
        b1 = beta1[grp]
        b2 = beta2[grp]
        step_size = lr[grp] / bias_corr1[grp]
        inv_sqrt_bc2 = float32(1.0) / math.sqrt(bias_corr2[grp])
        wd = weight_decay[grp]
        for i in range(chunk_start[c] + tid, chunk_end[c], cuda.blockDim.x):
            p = master[i]
            g = float32(grad[i]) * inv_scale
            if decoupled:
                p = p * (float32(1.0) - lr[grp] * wd)
            else:
                g = g + wd * p
            m = b1 * exp_avg[i] + (float32(1.0) - b1) * g
            v = b2 * exp_avg_sq[i] + (float32(1.0) - b2) * g * g
            exp_avg[i] = m
            exp_avg_sq[i] = v
            p = p - step_size * m / (math.sqrt(v) * inv_sqrt_bc2 + eps[grp])
            master[i] = p
            if write_half:
                half[i] = p
