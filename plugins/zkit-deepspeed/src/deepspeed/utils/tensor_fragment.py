"""``deepspeed.utils.tensor_fragment``: a parameter's full gradient, fp32 master and optimizer state,
read and written with every rank taking part (:mod:`zkit.zero.full_state`). Between the last
backward of a batch and ``step`` for gradients; any time for the master and the state.

DeepSpeed's ``safe_*_local_*`` variants (this rank's fragment of the parameter, flat) are
refused: zkit's fragments follow its own shard layout, so the full variants are the portable
ones.
"""
from __future__ import annotations

from typing import Any

import torch

from deepspeed.refused import FeatureNotProvided

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's full fp32 master."""
    from zkit.zero import get_full_fp32_param

    return get_full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the parameter's fp32 master and the parameter."""
    from zkit.zero import set_full_fp32_param

    set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer's ``optim_state_key`` state of the parameter, whole."""
    from zkit.zero import get_full_optimizer_state

    return get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace the optimizer's ``optim_state_key`` state of the parameter."""
    from zkit.zero import set_full_optimizer_state

    set_full_optimizer_state(param, value, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's reduced (data-parallel averaged) gradient, whole, in fp32; None if none."""
    from zkit.zero import get_full_grad

    return get_full_grad(param)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the parameter's reduced gradient before ``step``."""
    from zkit.zero import set_full_grad

    set_full_grad(param, value)


def safe_update_full_grad_vectorized(param_list: list[torch.nn.Parameter], update_func: Any) -> None:
    """``update_func(old_grad, param)`` gives each parameter's new full gradient."""
    for param in param_list:
        safe_set_full_grad(param, update_func(safe_get_full_grad(param), param))


def _local(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise FeatureNotProvided(
            f"deepspeed.utils.{name} (this rank's fragment of a parameter, in DeepSpeed's shard layout) is not "
            f"provided by zkit: use {name.replace('_local_', '_full_')}, which every rank calls together",
            name=f"deepspeed.utils.{name}")

    refused.__name__ = refused.__qualname__ = name
    return refused


safe_get_local_fp32_param = _local("safe_get_local_fp32_param")
safe_get_local_grad = _local("safe_get_local_grad")
safe_get_local_optimizer_state = _local("safe_get_local_optimizer_state")
safe_set_local_fp32_param = _local("safe_set_local_fp32_param")
safe_set_local_grad = _local("safe_set_local_grad")
safe_set_local_optimizer_state = _local("safe_set_local_optimizer_state")
