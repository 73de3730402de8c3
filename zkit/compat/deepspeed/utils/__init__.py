"""``deepspeed.utils``: the logger, rank-filtered logging, and helpers scripts import from it."""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from zkit.data import RepeatingLoader

__all__ = ["RepeatingLoader", "log_dist", "logger", "print_dist", "safe_get_full_fp32_param",
           "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
           "set_z3_leaf_modules"]

#: zkit's logger (DeepSpeed scripts log through ``deepspeed.utils.logger``)
logger = logging.getLogger("zkit")


def _message(message: str, ranks: list[int] | None) -> str | None:
    """``[Rank r] message`` when this rank should log it: always outside a process group, else
    when ``ranks`` holds this rank or -1 (DeepSpeed's rule: ``ranks=None`` logs nowhere)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    ranks = ranks or []
    if ranks and (ranks[0] == -1 or rank in set(ranks)):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    text = _message(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    text = _message(message, ranks)
    if text is not None:
        print(text)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any]) -> list[torch.nn.Module]:
    """DeepSpeed fetches a "leaf" module's whole subtree at once (for modules whose forward uses
    their children's parameters in a data-dependent order, as mixture-of-experts layers do).
    zkit gathers a partitioned parameter on use, in whatever order the forward uses them, so the
    marking needs nothing more. Returns the matching modules, as DeepSpeed does."""
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    return [m for m in model.modules() if isinstance(m, classes) or type(m).__name__ in names]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's full fp32 master (every rank calls it together)."""
    from zkit.zero.full_state import get_full_fp32_param

    return get_full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the parameter's fp32 master and the parameter (every rank together)."""
    from zkit.zero.full_state import set_full_fp32_param

    set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer's ``optim_state_key`` state of the parameter, whole (every rank together)."""
    from zkit.zero.full_state import get_full_optimizer_state

    return get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace the optimizer's ``optim_state_key`` state of the parameter."""
    from zkit.zero.full_state import set_full_optimizer_state

    set_full_optimizer_state(param, value, optim_state_key)
