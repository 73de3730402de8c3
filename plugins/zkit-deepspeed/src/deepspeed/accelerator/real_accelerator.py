"""The device this process trains on, behind DeepSpeed's accelerator interface
(``deepspeed.accelerator.get_accelerator()``): scripts ask it for the device name, the
communication backend, seeds, memory figures and pinned host memory without naming CUDA.

Two accelerators: ``cuda`` when ``torch.cuda.is_available()``, else ``cpu`` (what DeepSpeed picks
with ``DS_ACCELERATOR=cpu``). ``ZKIT_ACCELERATOR`` or ``DS_ACCELERATOR`` set to ``cpu`` forces the
CPU one on a GPU machine; a name zkit has no accelerator for (``xpu``, ``hpu``, ``npu``, ``mps``)
is refused with the list.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

_KNOWN = ("cuda", "cpu")


class Accelerator:
    """DeepSpeed's accelerator methods over one torch device type."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"
        self._module: Any = torch.cuda if name == "cuda" else None

    # -- identity -------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._module is not None:
            self._module.set_device(device_index)

    def current_device(self) -> int:
        return self._module.current_device() if self._module is not None else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        return self._module.device_count() if self._module is not None else 1

    def is_available(self) -> bool:
        return self._module.is_available() if self._module is not None else True

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- dtypes ---------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return self._module.is_bf16_supported() if self._module is not None else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.float16]
        return dtypes + [torch.bfloat16] if self.is_bf16_supported() else dtypes

    # -- synchronisation and streams ------------------------------------------------------------
    def synchronize(self, device_index: int | None = None) -> None:
        if self._module is not None:
            self._module.synchronize(device_index)

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._module.Stream(*args, **kwargs) if self._module is not None else None

    def stream(self, stream: Any) -> Any:
        import contextlib

        return self._module.stream(stream) if self._module is not None and stream is not None \
            else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._module.current_stream(device_index) if self._module is not None else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._module.default_stream(device_index) if self._module is not None else None

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._module.Event(**kwargs) if self._module is not None else None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._module is not None:
            self._module.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._module is not None:
            self._module.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return self._module._lazy_call(callback) if self._module is not None else callback()

    # -- random numbers -------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return self._module.manual_seed(seed) if self._module is not None else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return self._module.manual_seed_all(seed) if self._module is not None else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return self._module.initial_seed() if self._module is not None else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._module is not None:
            return self._module.get_rng_state() if device_index is None else self._module.get_rng_state(device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._module is not None:
            if device_index is None:
                self._module.set_rng_state(new_state)
            else:
                self._module.set_rng_state(new_state, device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return self._module.default_generators[device_index] if self._module is not None else torch.default_generator

    # -- memory ---------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._module is not None:
            self._module.empty_cache()

    def _host_used(self) -> int:
        """This process's resident memory (DeepSpeed's CPU accelerator reports host memory too)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._module.memory_allocated(device_index) if self._module is not None else self._host_used()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._module.max_memory_allocated(device_index) if self._module is not None else self._host_used()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._module is not None:
            self._module.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.memory_reserved(device_index) if self._module is not None else self._host_used()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._module.max_memory_reserved(device_index) if self._module is not None else self._host_used()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return self._module.memory_stats(device_index) if self._module is not None else {}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._module is not None:
            return self._module.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._module is not None:
            free, _ = self._module.mem_get_info(device_index)
            return free
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # -- host memory ----------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._module is not None else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._module is not None else False

    # -- tensor types DeepSpeed scripts name ----------------------------------------------------
    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self.device_name()

        def make(*args: Any) -> torch.Tensor:
            if len(args) == 1 and not isinstance(args[0], int):
                return torch.tensor(args[0], dtype=dtype, device=device)
            return torch.empty(*args, dtype=dtype, device=device)

        return make

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's names
        return self._tensor_type(torch.bfloat16)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.float16)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.float32)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.float64)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.int64)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.uint8)

    # -- environment ----------------------------------------------------------------------------
    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return "inductor"

    def __repr__(self) -> str:
        return f"zkit accelerator {self._name!r} (backend {self._communication_backend_name})"


_current: Accelerator | None = None


def _chosen_name() -> str:
    forced = os.environ.get("ZKIT_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in _KNOWN:
            raise ValueError(f"accelerator {forced!r} (from ZKIT_ACCELERATOR/DS_ACCELERATOR) is not one zkit has: "
                             f"{', '.join(_KNOWN)}")
        if forced == "cuda" and not torch.cuda.is_available():
            raise ValueError("accelerator 'cuda' was asked for (ZKIT_ACCELERATOR/DS_ACCELERATOR) but torch sees no "
                             "CUDA device")
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The accelerator of this process (chosen once)."""
    global _current
    if _current is None:
        _current = Accelerator(_chosen_name())
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    global _current
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in _KNOWN
