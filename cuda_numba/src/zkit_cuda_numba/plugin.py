"""zkit plugin entry point of zkit-cuda-numba: the fused CUDA Adam, when the engine uses it, and
the kernels' status.

Numba is imported only when the availability check first runs (``zkit report``, registration, a
config asking for the kernel on a CUDA device), never at import of this module. Without a usable
GPU (and outside the simulator) the optimizer is not registered, and ``zkit report`` says why.

Which Adam the engine steps on a GPU. DeepSpeed steps its FusedAdam for a config's ``"Adam"`` and
``"AdamW"`` on a GPU. zkit keeps those two types on torch's Adam/AdamW with ``fused=True`` on every
device: torch's own fused CUDA kernel, torch's numerics by definition, and a config must not change
what it computes because a plugin was installed. The opt-in is the name of DeepSpeed's class:
``"type": "FusedAdam"`` (or ``"fused_adam"``) on a ``cuda`` device steps with this distribution's
kernel (record ``fused_adam_cuda``: the same settings, read by zkit's ``adam_settings``, and the
same results up to fp32 rounding, with the partitioner's unscale and clip factor folded into the
kernel). On any other device, or where the kernels cannot run, ``"FusedAdam"`` is zkit's built-in
alias of ``"Adam"``, so one config runs everywhere. The choice is this plugin's answer to
``zkit_configure``, which gets the engine's device; a ``zkit.Stack(optimizer=...)`` overrides it.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

import zkit
from zkit.records import OptimizerRecord

from zkit_cuda_numba import runtime

log = logging.getLogger("zkit")

#: config optimizer types (lower case) that the kernel answers for on its devices
FUSED_ADAM_TYPES = ("fusedadam", "fused_adam")


def _fused_adam(param_groups, **params: Any):
    """The engine's FusedAdamCUDA: the config's Adam settings with DeepSpeed's names and defaults
    (``adam_w_mode`` true by default), stepping the partitioner's master views where they are."""
    from zkit.builtin.optim_torch import adam_settings
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
                "config type FusedAdam selects it on CUDA devices",
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


def wants_kernel(optimizer_type: str | None, device: torch.device | None) -> bool:
    """Whether a config's optimizer type asks for this kernel on ``device`` (see the module
    docstring); the kernels' availability is not checked here."""
    if optimizer_type is None or device is None:
        return False
    return optimizer_type.strip().lower() in FUSED_ADAM_TYPES and device.type in FUSED_ADAM.devices


@zkit.hookimpl
def zkit_configure(config, device):
    optimizer = config.optimizer
    if not wants_kernel(optimizer.type if optimizer is not None else None, device):
        return None
    reason = runtime.unavailable_reason()
    if reason is not None:
        log.warning("optimizer %r on %s: zkit-cuda-numba's kernel cannot run (%s); torch's fused Adam steps instead",
                    optimizer.type, device, reason)
        return None
    return zkit.Stack(optimizer=FUSED_ADAM.name)


@zkit.hookimpl
def zkit_report():
    yield "zkit-cuda-numba", runtime.describe()
    reason = runtime.unavailable_reason()
    if reason is None:
        yield "zkit-cuda-numba fused Adam", ("config type FusedAdam on a cuda device steps with fused_adam_cuda; "
                                             "Adam and AdamW step with torch's fused Adam")
    else:
        yield "zkit-cuda-numba fused Adam", (f"not registered ({reason}); config type FusedAdam steps with "
                                             "torch's fused Adam")
