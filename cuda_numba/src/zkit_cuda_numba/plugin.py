"""zkit plugin entry point of zkit-cuda-numba: the fused CUDA Adam and the kernels' status.

Numba is imported only when the availability check first runs (``zkit report``, registration),
never at import of this module. Without a usable GPU (and outside the simulator) the optimizer is
not registered, and ``zkit report`` says why.
"""
from __future__ import annotations

import zkit
from zkit.records import OptimizerRecord

from zkit_cuda_numba import runtime


def _fused_adam(param_groups, **params):
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    return FusedAdamCUDA(param_groups, **params)


@zkit.hookimpl
def zkit_register_optimizers():
    if runtime.unavailable_reason() is not None:
        return
    yield OptimizerRecord(
        name="fused_adam_cuda",
        factory=_fused_adam,
        description="Adam/AdamW in one Numba-CUDA launch over flat buffers (fused unscale + inf check)",
        aliases=("fusedadam_cuda",),
        state_names=("exp_avg", "exp_avg_sq"),
        elementwise=True,
        devices=("cuda",),
    )


@zkit.hookimpl
def zkit_report():
    yield "zkit-cuda-numba", runtime.describe()
