"""DeepSpeed's record of *external* parameters: a module's ``_external_params`` holds the partitioned
parameters its forward uses that belong to other modules.

zkit gathers a partitioned parameter wherever it is used, so the record changes no gathering; it
is kept, with DeepSpeed's rules, for code that reads it. Besides explicit registration, a
parameter returned from a module's forward is registered on the innermost running module that
called it (and unregistered from the returning module, where the caller now covers it), as
DeepSpeed's ZeRO-3 hooks do; :func:`track_returned_params` installs those hooks on a model
(``deepspeed.initialize`` does at stage 3). Stage 3 itself keeps a returned parameter gathered
until the end of forward (:mod:`zkit.zero.returned`).
"""
from __future__ import annotations

import itertools
import types
from typing import Any

import torch

from zkit.zero import returned_params

__all__ = ["register_external_parameter", "track_returned_params", "unregister_external_parameter"]


def _init_external_params(module: torch.nn.Module) -> None:
    if hasattr(module, "_external_params"):
        return
    module._external_params = {}

    def ds_external_parameters(self: torch.nn.Module) -> Any:
        return self._external_params.items()

    def all_parameters(self: torch.nn.Module) -> Any:
        return itertools.chain(self.named_parameters(recurse=False), self._external_params.items())

    module.ds_external_parameters = types.MethodType(ds_external_parameters, module)
    module.all_parameters = types.MethodType(all_parameters, module)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Record that ``module``'s forward uses ``parameter`` of another module (DeepSpeed's API)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(f"register_external_parameter: the parameter must be a torch.nn.Parameter, "
                           f"got {type(parameter).__name__}")
    _init_external_params(module)
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`; the parameter must be registered on ``module``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(f"unregister_external_parameter: the parameter must be a torch.nn.Parameter, "
                           f"got {type(parameter).__name__}")
    if id(parameter) not in getattr(module, "_external_params", {}):
        raise RuntimeError("unregister_external_parameter: the parameter is not a registered external parameter "
                           "of the module")
    del module._external_params[id(parameter)]


def track_returned_params(model: torch.nn.Module) -> list[Any]:
    """Give every module of ``model`` an ``_external_params`` record and register returned
    parameters on their callers; returns the hook handles."""
    running: list[torch.nn.Module] = []

    def before(module: torch.nn.Module, args: Any) -> None:
        running.append(module)

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        if running and running[-1] is module:
            running.pop()
        if not running:
            return
        for param in returned_params(output):
            if any(id(param) in m._external_params for m in running):
                continue
            register_external_parameter(running[-1], param)
            # the caller covers it now
            module._external_params.pop(id(param), None)

    handles = []
    for module in model.modules():
        _init_external_params(module)
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after, always_call=True))
    return handles
