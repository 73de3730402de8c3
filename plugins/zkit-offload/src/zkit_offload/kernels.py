"""Fused, multi-threaded Numba kernels over flat fp32 buffers for the CPU optimizers.

Each update kernel makes one pass over memory: it reads the gradient, multiplies it by
``grad_factor`` (fp16 loss-scale unscaling and gradient clipping folded into one number), updates
the parameter and its state in place and, when asked, writes the updated parameter as a 16-bit
copy (fp16 or bf16 bit patterns in a ``uint16`` array; the CPU target of Numba has no float16
arrays). :func:`grad_stats` is the pass that comes before it when the step must be skippable: it
reads the gradient once and returns its squared norm and the number of inf/nan elements, so a
step that would see an overflow is refused before any parameter or state is touched.

Scalars are passed as ``np.float32`` so that the arithmetic stays in fp32 like torch's fused
kernels (a Python float would widen every operation to fp64). ``fastmath`` is on: it lets LLVM
vectorise the square roots and divisions; NaN/inf tests are therefore done on the bits.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from zkit_offload import numba_setup  # noqa: F401  (cache dir and threading layer first)

#: ``out_kind`` values of the update kernels.
OUT_NONE, OUT_FP16, OUT_BF16 = 0, 1, 2

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
#: Whether LLVM lowers an fp32 -> fp16 conversion to an instruction here (F16C on x86; always on
#: ARM). Without it the fp16 copy-out is done by torch after the kernel.
HARDWARE_HALF = (not _X86) or ("+f16c" in llvm.get_host_cpu_features().flatten().split(","))

_JIT = dict(parallel=True, fastmath=True, cache=True, nogil=True)


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of an fp32 value as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f16_bits(typingctx, x):
    """fp32 -> fp16 (round to nearest even, like torch's cast) as uint16 bits."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        if not HARDWARE_HALF:  # never called then (see HARDWARE_HALF); keep the kernel linkable
            return ir.Constant(ir.IntType(16), 0)
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always", fastmath=True)
def _bf16_bits(x):
    """fp32 -> bf16 bits exactly as torch rounds: nearest even, any NaN becomes 0x7FC0."""
    u = _f32_bits(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**_JIT)
def grad_stats(g, g_bits, factor):
    """``(sum of (g*factor)**2 in fp64, number of inf/nan elements of g)``; ``g_bits`` is
    ``g.view(np.uint32)``."""
    sumsq = 0.0
    bad = 0
    for i in prange(g.size):
        x = np.float64(g[i] * factor)
        sumsq += x * x
        bad += ((np.int64(g_bits[i]) >> 23) & 0xFF) // 0xFF  # exponent all ones: inf or nan
    return sumsq, bad


# Each update kernel has one loop per ``out_kind`` around an inlined element function: a branch
# inside the loop would stop LLVM from vectorising it.


@njit(inline="always", fastmath=True)
def _adam(p, g, m, v, i, w1, beta2, w2, eps, l2, decay, step_size, bias2_sqrt, grad_factor):
    pi = p[i] * decay
    gi = g[i] * grad_factor + l2 * pi
    mi = m[i] + w1 * (gi - m[i])
    vi = beta2 * v[i] + w2 * gi * gi
    pi = pi - step_size * mi / (np.sqrt(vi) / bias2_sqrt + eps)
    m[i] = mi
    v[i] = vi
    p[i] = pi
    return pi


@njit(**_JIT)
def adam_update(p, g, m, v, out, out_kind, lr, w1, beta2, w2, eps, l2, decay, bias1, bias2_sqrt, grad_factor):
    """Adam/AdamW in one pass. ``l2``: L2 weight decay added to the gradient (Adam); ``decay``:
    the decoupled factor ``1 - lr*weight_decay`` the parameter is multiplied by (AdamW), 1 for
    none. ``w1 = 1 - beta1`` and ``w2 = 1 - beta2`` come rounded from fp64 (``1 - fp32(0.9999)``
    in fp32 is off by 1.7e-4 relative). Follows torch's fused CPU formula (``exp_avg`` by lerp,
    ``denom = sqrt(v)/bc2 + eps``)."""
    step_size = lr / bias1
    if out_kind == OUT_FP16:
        for i in prange(p.size):
            out[i] = _f16_bits(_adam(p, g, m, v, i, w1, beta2, w2, eps, l2, decay, step_size, bias2_sqrt, grad_factor))
    elif out_kind == OUT_BF16:
        for i in prange(p.size):
            out[i] = _bf16_bits(_adam(p, g, m, v, i, w1, beta2, w2, eps, l2, decay, step_size, bias2_sqrt, grad_factor))
    else:
        for i in prange(p.size):
            _adam(p, g, m, v, i, w1, beta2, w2, eps, l2, decay, step_size, bias2_sqrt, grad_factor)


@njit(inline="always", fastmath=True)
def _adagrad(p, g, s, i, clr, eps, l2, grad_factor):
    pi = p[i]
    gi = g[i] * grad_factor + l2 * pi
    si = s[i] + gi * gi
    pi = pi - clr * gi / (np.sqrt(si) + eps)
    s[i] = si
    p[i] = pi
    return pi


@njit(**_JIT)
def adagrad_update(p, g, s, out, out_kind, clr, eps, l2, grad_factor):
    """Adagrad in one pass (torch's formula: ``sum += g*g``; ``p -= clr * g / (sqrt(sum) + eps)``)."""
    if out_kind == OUT_FP16:
        for i in prange(p.size):
            out[i] = _f16_bits(_adagrad(p, g, s, i, clr, eps, l2, grad_factor))
    elif out_kind == OUT_BF16:
        for i in prange(p.size):
            out[i] = _bf16_bits(_adagrad(p, g, s, i, clr, eps, l2, grad_factor))
    else:
        for i in prange(p.size):
            _adagrad(p, g, s, i, clr, eps, l2, grad_factor)


@njit(inline="always", fastmath=True)
def _lion(p, g, m, i, lr, beta1, w1, beta2, w2, decay, grad_factor):
    gi = g[i] * grad_factor
    mi = m[i]
    c = beta1 * mi + w1 * gi
    sign = np.float32(c > 0) - np.float32(c < 0)
    pi = p[i] * decay - lr * sign
    m[i] = beta2 * mi + w2 * gi
    p[i] = pi
    return pi


@njit(**_JIT)
def lion_update(p, g, m, out, out_kind, lr, beta1, w1, beta2, w2, decay, grad_factor):
    """Lion in one pass: ``p = p*decay - lr*sign(b1*m + w1*g)``; ``m = b2*m + w2*g`` with
    ``w = 1 - b`` rounded from fp64."""
    if out_kind == OUT_FP16:
        for i in prange(p.size):
            out[i] = _f16_bits(_lion(p, g, m, i, lr, beta1, w1, beta2, w2, decay, grad_factor))
    elif out_kind == OUT_BF16:
        for i in prange(p.size):
            out[i] = _bf16_bits(_lion(p, g, m, i, lr, beta1, w1, beta2, w2, decay, grad_factor))
    else:
        for i in prange(p.size):
            _lion(p, g, m, i, lr, beta1, w1, beta2, w2, decay, grad_factor)
