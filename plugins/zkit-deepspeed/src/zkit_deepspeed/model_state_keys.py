"""The top-level keys DeepSpeed writes beside the weights in a checkpoint's model-states file
(``ds_config``, ``ds_version``, ``buffer_names``, ``param_shapes``, ``frozen_param_shapes``,
``shared_params``). The drop-in saves them in the client state of zkit's checkpoint, so that
``load_checkpoint`` returns them as DeepSpeed's does and Lightning's converted checkpoint keeps them
(``deepspeed.utils.zero_to_fp32.get_model_state_file`` puts the client state at the top level).

DeepSpeed lists ``param_shapes`` per optimizer parameter group of its flat buffers; zkit's
partitioner has no such groups, so the list holds one ordered dict of every trainable parameter."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["deepspeed_model_state_keys"]


def deepspeed_model_state_keys(engine: Any, exclude_frozen_parameters: bool) -> dict[str, Any]:
    from deepspeed import __version__

    module = engine.module
    stage = engine.zero_optimization_stage()
    config = engine.config.raw or engine.config.to_dict()
    keys: dict[str, Any] = {"buffer_names": _buffer_names(module), "ds_config": config, "ds_version": __version__,
                            "param_shapes": None, "frozen_param_shapes": None, "shared_params": None}
    if stage > 0:  # DeepSpeed's ZeRO optimizer state: the weights are in the flat groups, named by these
        keys["param_shapes"] = [OrderedDict((n, _shape(p)) for n, p in module.named_parameters() if p.requires_grad)]
        keys["shared_params"] = _shared(module)
    if stage >= 2 and not exclude_frozen_parameters:
        keys["frozen_param_shapes"] = OrderedDict((n, _shape(p)) for n, p in module.named_parameters()
                                                  if not p.requires_grad)
    return keys


def _shape(p: torch.nn.Parameter) -> torch.Size:
    return torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape


def _buffer_names(module: torch.nn.Module) -> list[str]:
    """The persistent buffers' names, as ``state_dict`` has them."""
    names = []
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _shared(module: torch.nn.Module) -> dict[str, str]:
    """``{name not stored: name holding the data}`` of tied parameters."""
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        holder = first.setdefault(id(p), name)
        if holder != name:
            shared[name] = holder
    return shared
