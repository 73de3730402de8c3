"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, the
parameter status enum and external-parameter registration, over :mod:`zkit.zero`."""
from __future__ import annotations

import torch

from zkit.zero import GatheredParameters, Init
from zkit.zero.sharded_params import ParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


#: DeepSpeed's name for the states of a partitioned parameter (its ``ds_status``)
ZeroParamStatus = ParamStatus


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
