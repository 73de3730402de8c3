"""DeepSpeed's batch-size rule: ``train_batch_size = micro * gradient_accumulation_steps *
world_size``. Any two of the three determine the third; ``train_batch_size`` alone means one
accumulation step; ``train_micro_batch_size_per_gpu`` alone means one accumulation step too.
Unlike DeepSpeed, a value that does not divide evenly is an error instead of being floored.
"""
from __future__ import annotations

from typing import Any

from zkit.core.config.errors import ConfigError, auto_error

TB = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    if value == "auto":
        raise auto_error(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError.at(name, f"must be an int, got {value!r}")
    if value < 1:
        raise ConfigError.at(name, f"must be >= 1, got {value!r}")
    return value


def resolve_batch(
    train_batch_size: Any, micro_batch: Any, accumulation: Any, world_size: int
) -> tuple[int, int, int]:
    """Return ``(train_batch_size, train_micro_batch_size_per_gpu,
    gradient_accumulation_steps)`` from the given ones (``None`` = not given)."""
    tb = _count(TB, train_batch_size)
    micro = _count(MICRO, micro_batch)
    gas = _count(GAS, accumulation)
    ws = world_size
    if tb is None and micro is None:
        raise ConfigError(
            f"Either {TB} or {MICRO} needs to be provided (world size {ws}); "
            f"{GAS} alone does not determine the batch size"
        )
    if tb is not None and micro is not None and gas is not None:
        if tb != micro * gas * ws:
            raise ConfigError(
                f"{TB} {tb} != {MICRO} {micro} * {GAS} {gas} * world size {ws} "
                f"(= {micro * gas * ws})"
            )
        return tb, micro, gas
    if tb is not None and micro is not None:
        if tb % (micro * ws):
            raise ConfigError(
                f"{TB} {tb} is not divisible by {MICRO} {micro} * world size {ws} "
                f"(= {micro * ws}), so {GAS} cannot be derived"
            )
        return tb, micro, tb // (micro * ws)
    if tb is not None:
        gas = 1 if gas is None else gas
        if tb % (gas * ws):
            raise ConfigError(
                f"{TB} {tb} is not divisible by {GAS} {gas} * world size {ws} (= {gas * ws}), "
                f"so {MICRO} cannot be derived"
            )
        return tb, tb // (gas * ws), gas
    gas = 1 if gas is None else gas
    return micro * gas * ws, micro, gas
