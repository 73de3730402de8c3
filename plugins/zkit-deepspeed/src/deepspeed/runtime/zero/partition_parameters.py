"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, the
parameter status enum and external-parameter registration (:mod:`.external_params`), over
:mod:`zkit.zero`."""
from __future__ import annotations

import torch

from typing import Any, Callable

from deepspeed.accelerator.real_accelerator import get_accelerator
from deepspeed.runtime.zero.external_params import register_external_parameter, unregister_external_parameter
from zkit.zero import GatheredParameters, Init, ParamStatus

__all__ = ["GatheredParameters", "Init", "MultipleAllGatherHandles", "ZeroParamStatus", "get_accelerator",
           "partitioned_param_data_shape", "register_external_parameter", "unregister_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

#: DeepSpeed's shape of a released parameter's ``.data`` (an empty tensor). zkit's released
#: parameter keeps its full shape (its data is an expanded view), so code that detects a
#: released parameter should read ``param.ds_status`` rather than compare shapes.
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Waits on several gather handles in turn, passing ``handle_dependency`` by keyword (a handle's
    ``wait`` may take it positionally, keyword-only, or in ``**kwargs``)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


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

from deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
