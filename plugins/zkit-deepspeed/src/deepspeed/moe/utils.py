"""``deepspeed.moe.utils``: parameter-group helpers, for models without experts."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

_NO_EXPERTS = ("zkit has no mixture-of-experts (expert-parallel) training: the model has expert parameters "
               "(allreduce=False), which zkit would reduce like any other")


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter: ``param.allreduce`` set to False."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    experts = [p for p in params if is_moe_param(p)]
    return shared, experts


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: int | float = 178956971) -> list[dict]:
    """DeepSpeed's signature: the groups as a list, expert parameters moved into groups of their
    own. Without expert parameters (every model zkit trains) the groups come back unchanged."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    if any(is_moe_param(p) for group in param_groups for p in group["params"]):
        raise NotImplementedError(_NO_EXPERTS)
    return param_groups
