"""Checking optimizer parameters from a config: unknown names with a "did you mean", bad values
with the rule they break."""
from __future__ import annotations

import difflib
import math
from typing import Any, Iterable


def check_names(optimizer: str, given: Iterable[str], valid: Iterable[str]) -> None:
    valid = sorted(valid)
    for name in given:
        if name in valid:
            continue
        msg = f"unknown {optimizer} parameter {name!r}"
        close = difflib.get_close_matches(name, valid, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        raise ValueError(f"{msg} Valid parameters: {', '.join(valid)}")


def check_adam_values(
    optimizer: str, lr: Any, betas: Any, eps: Any, weight_decay: Any, freeze_step: Any = None
) -> None:
    """Adam's values; ``freeze_step`` (1-bit Adam's) is checked unless None."""
    if not _finite(lr) or lr < 0:
        raise ValueError(f"{optimizer}: lr must be a finite number >= 0, got {lr!r}")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(_finite(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{optimizer}: betas must be two numbers in [0, 1), got {betas!r}")
    if not _finite(eps) or eps <= 0:
        raise ValueError(f"{optimizer}: eps must be a finite number > 0, got {eps!r}")
    if not _finite(weight_decay) or weight_decay < 0:
        raise ValueError(f"{optimizer}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if freeze_step is None:
        return
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int):
        raise ValueError(f"{optimizer}: freeze_step must be an integer, got {freeze_step!r}")
    if freeze_step < 1:
        raise ValueError(
            f"{optimizer}: freeze_step must be >= 1, got {freeze_step}: the variance is estimated with "
            f"full-precision gradients for freeze_step steps and frozen afterwards, so at least one "
            f"warm-up step is needed"
        )


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_positive_ints(optimizer: str, **values: Any) -> None:
    """Each value must be an integer >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{optimizer}: {name} must be an integer >= 1, got {value!r}")
