"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, the
parameter status enum and external-parameter registration, over :mod:`zkit.zero`."""
from __future__ import annotations

import torch

from typing import Any, Callable

from zkit.accelerator import get_accelerator
from zkit.zero import GatheredParameters, Init
from zkit.zero.sharded_params import ParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]


#: DeepSpeed's name for the states of a partitioned parameter (its ``ds_status``)
ZeroParamStatus = ParamStatus


# torch's constructors as DeepSpeed keeps them. DeepSpeed's Init replaces torch.tensor, torch.empty
# ... with zero_wrapper_for_fp_tensor_constructor(...) while it is active; zkit's Init converts
# parameters as it partitions them and replaces no constructor, so nothing calls the wrapper
# here. It is kept, with DeepSpeed's behaviour, for code that calls or patches it (transformers
# swaps it to keep torch.arange's dtype).
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: Any) -> Callable[..., torch.Tensor]:
    """``fn`` creating its tensor on ``target_device`` (unless a device is given) and converting
    a floating result to ``target_fp_dtype``."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def _check(module: torch.nn.Module, parameter: torch.nn.Parameter, what: str) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"{what}: parameter must be a torch.nn.Parameter, got {type(parameter).__name__}")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed needs to be told when a module's forward uses a parameter of another module, so
    its hooks gather it. zkit gathers a partitioned parameter wherever it is used (the parameter
    itself fetches its unit on first use), so registration is checked and needs nothing more."""
    _check(module, parameter, "register_external_parameter")


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """The inverse of :func:`register_external_parameter` (nothing to undo)."""
    _check(module, parameter, "unregister_external_parameter")
