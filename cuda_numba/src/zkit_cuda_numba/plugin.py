"""zkit plugin entry point of zkit-cuda-numba: the fused CUDA Adam, when the engine uses it, and
the kernels' status.

Numba is imported only when the availability check first runs (``zkit report``, registration, a
config asking for the kernel on a CUDA device), never at import of this module. Without a usable
GPU (and outside the simulator) the optimizer is not registered, and ``zkit report`` says why.

Which Adam the engine steps on a GPU. Every Adam type of a config, DeepSpeed's ``"FusedAdam"``
(``"fused_adam"``) included, steps with torch's Adam/AdamW with ``fused=True``: torch's own fused
CUDA kernel, torch's numerics, and a config computes the same thing whether or not a plugin is
installed. The Numba kernel (record ``fused_adam_cuda``: the same settings, read by zkit's
``adam_settings``, with the partitioner's unscale and clip factor and the 16-bit copy folded into
its one pass) is chosen by name only, ``"type": "fused_adam_cuda"`` in the config or
``zkit.Stack(optimizer="fused_adam_cuda")``. Measured on one H100, the engine's step with it took
1.04-1.71x the time of torch's fused kernel (``contrib/bench/bench_fused_adam_cuda.py
--engine``), so a DeepSpeed config naming ``"FusedAdam"`` for speed gets torch's.
"""
from __future__ import annotations

from typing import Any

import zkit
from zkit.core.plugin_manager import PluginError
from zkit.core.records import OptimizerRecord

from zkit_cuda_numba import runtime


def _fused_adam(param_groups, **params: Any):
    """The engine's FusedAdamCUDA: the config's Adam settings with DeepSpeed's names and defaults
    (``adam_w_mode`` true by default), stepping the partitioner's master views where they are."""
    from zkit.optim import adam_settings
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    decoupled, kwargs = adam_settings("fused_adam_cuda", params)
    kwargs.pop("fused"), kwargs.pop("foreach")  # torch's kernel choice: this is one kernel either way
    if kwargs.pop("maximize"):
        raise ValueError("optimizer 'fused_adam_cuda': maximize=true is not supported (the kernel minimises); "
                         "negate the loss instead")
    return FusedAdamCUDA(param_groups, adam_w_mode=decoupled, in_place=True, **kwargs)


FUSED_ADAM = OptimizerRecord(
    name="fused_adam_cuda",
    factory=_fused_adam,
    description="Adam/AdamW in one Numba-CUDA launch per flat buffer (gradient factor and inf check fused); "
                "chosen by name (config type fused_adam_cuda) on CUDA devices",
    aliases=("fusedadam_cuda",),
    state_names=("exp_avg", "exp_avg_sq"),
    state_format="adam",  # torch Adam's state layout: checkpoints move between the two
    elementwise=True,
    devices=("cuda",),
)


@zkit.hookimpl
def zkit_register_optimizers():
    if runtime.unavailable_reason() is not None:
        return
    yield FUSED_ADAM


@zkit.hookimpl
def zkit_configure(config):
    """A config that names the kernel where it cannot run is refused here, at initialize, with
    the reason (the record is not registered, so the name alone would read as a typo)."""
    optimizer = config.optimizer
    named = optimizer is not None and (optimizer.type or "").strip().lower() in (FUSED_ADAM.name, *FUSED_ADAM.aliases)
    reason = runtime.unavailable_reason() if named else None
    if reason is not None:
        raise PluginError(f"optimizer {optimizer.type!r} is zkit-cuda-numba's Numba kernel, which cannot run here: "
                          f"{reason}. Use \"Adam\" or \"FusedAdam\" (torch's fused Adam) instead")
    return None


@zkit.hookimpl
def zkit_report():
    yield "zkit-cuda-numba", runtime.describe()
    reason = runtime.unavailable_reason()
    if reason is None:
        yield "zkit-cuda-numba fused Adam", ("config type fused_adam_cuda on a cuda device steps with the Numba "
                                             "kernel; Adam, AdamW and FusedAdam step with torch's fused Adam")
    else:
        yield "zkit-cuda-numba fused Adam", (f"not registered ({reason}); Adam, AdamW and FusedAdam step with "
                                             "torch's fused Adam")
