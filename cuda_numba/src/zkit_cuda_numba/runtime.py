"""Lazy Numba-CUDA access: whether kernels can run here, why not, and zero-copy launches.

Nothing here imports numba at module import time: ``import zkit_cuda_numba`` stays cheap and works
without numba-cuda, and ``zkit report`` can say why the kernels are off. Two ways to run:

* a CUDA GPU: torch CUDA tensors are passed zero-copy through ``__cuda_array_interface__`` and
  kernels launch on torch's current stream;
* Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba is first imported), used by
  the test-suite on machines without a GPU: CPU torch tensors are passed as numpy views.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is (or will be) active in this process."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def cuda_module():
    """``numba.cuda``, imported on first use."""
    from numba import cuda

    return cuda


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """``None`` when the kernels can run (GPU or simulator), else a sentence saying why not."""
    try:
        cuda = cuda_module()
    except Exception as exc:  # numba or numba-cuda missing or broken
        return f"numba.cuda cannot be imported ({type(exc).__name__}: {exc})"
    if simulator_enabled():
        return None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        if not cuda.is_available():
            return "numba.cuda finds no usable CUDA driver"
    except Exception as exc:
        return f"numba.cuda driver check failed ({type(exc).__name__}: {exc})"
    return None


def describe() -> str:
    """One line for ``zkit report``."""
    reason = unavailable_reason()
    if simulator_enabled():
        state = "simulator (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU, for tests only"
        return state if reason is None else f"{state}; unusable: {reason}"
    if reason is None:
        return f"CUDA available ({torch.cuda.get_device_name()}); simulator: off"
    return f"CUDA not available because {reason}; simulator: off (NUMBA_ENABLE_CUDASIM=1 enables it)"


def require() -> Any:
    """``numba.cuda``, or a RuntimeError saying why the kernels cannot run."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"zkit-cuda-numba kernels cannot run: {reason}")
    return cuda_module()


def as_kernel_array(t: torch.Tensor):
    """A zero-copy array the kernel can take: a device array view of a CUDA tensor, or a numpy
    view of a CPU tensor under the simulator."""
    if t.dtype == torch.bfloat16:
        raise TypeError("bf16 tensors must be widened before a launch (numba has no bf16 arrays)")
    t = t.detach()
    if t.is_cuda:
        return cuda_module().as_cuda_array(t)
    if not simulator_enabled():
        raise RuntimeError(f"a CPU tensor reached a CUDA kernel outside the simulator ({t.device})")
    return t.numpy()


def launch_stream(device: torch.device) -> Any:
    """The Numba stream wrapping torch's current stream on ``device`` (0 under the simulator)."""
    if device.type != "cuda":
        return 0
    return cuda_module().external_stream(torch.cuda.current_stream(device).cuda_stream)
