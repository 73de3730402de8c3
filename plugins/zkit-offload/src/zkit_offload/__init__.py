"""CPU and NVMe offload (ZeRO-Offload, ZeRO-Infinity) and a fast CPU Adam for zkit.

Standalone pieces (usable without the engine)::

    from zkit_offload import CPUAdam, CPUAdamW, CPUAdagrad, CPULion   # fused Numba CPU optimizers
    from zkit_offload import NVMeSwapper, step_in_subgroups            # async swap to files
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "CPUAdagrad",
    "CPUAdam",
    "CPUAdamW",
    "CPULion",
    "HostAllocator",
    "NVMeAllocator",
    "NVMeSwapper",
    "SwapError",
    "step_in_subgroups",
    "__version__",
]

_LAZY = {
    "CPUAdam": "zkit_offload.cpu_adam",
    "CPUAdamW": "zkit_offload.cpu_adam",
    "CPUAdagrad": "zkit_offload.cpu_adagrad",
    "CPULion": "zkit_offload.cpu_lion",
    "NVMeSwapper": "zkit_offload.swap",
    "SwapError": "zkit_offload.swap",
    "step_in_subgroups": "zkit_offload.pipeline",
    "HostAllocator": "zkit_offload.allocators",
    "NVMeAllocator": "zkit_offload.allocators",
}


def __getattr__(name: str):
    # Lazy: loading the plugin (entry point) must not load Numba and compile kernels.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zkit_offload' has no attribute {name!r}")
