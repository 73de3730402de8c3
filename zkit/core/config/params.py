"""Checks for the ``params`` dict of a config's ``optimizer`` and ``scheduler`` sections.

Config values come from JSON/YAML, so they are checked here once, with messages that name the
optimizer or schedule and the offending key, instead of failing deep inside torch.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping, Sequence


def check_known(kind: str, name: str, params: Mapping[str, Any], valid: Iterable[str]) -> None:
    """Refuse keys that ``name`` does not take, suggesting the closest valid key.

    ``kind`` is ``"optimizer"`` or ``"scheduler"``; the message reads
    ``unknown parameter 'lrr' for optimizer 'adam'; did you mean 'lr'? valid: betas, eps, lr``.
    """
    valid = sorted(valid)
    for key in params:
        if key in valid:
            continue
        msg = f"unknown parameter {key!r} for {kind} {name!r}"
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        raise ValueError(f"{msg} valid: {', '.join(valid)}")


def _where(owner: str, key: str) -> str:
    return f"{owner}: {key}"


def number(owner: str, key: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number inside ``[low, high]`` (ends excluded when ``*_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{_where(owner, key)} must be a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value < low or (low_open and value == low)):
        op = ">" if low_open else ">="
        raise ValueError(f"{_where(owner, key)} must be {op} {low:g}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        op = "<" if high_open else "<="
        raise ValueError(f"{_where(owner, key)} must be {op} {high:g}, got {value!r}")
    return value


def integer(owner: str, key: str, value: Any, *, low: int | None = None) -> int:
    """An integer ``>= low``. Integral floats (``1e3`` from YAML) are accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_where(owner, key)} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{_where(owner, key)} must be >= {low}, got {value!r}")
    return value


def boolean(owner: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_where(owner, key)} must be true or false, got {value!r}")
    return value


def choice(owner: str, key: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(
            f"{_where(owner, key)} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


def betas(owner: str, value: Any) -> tuple[float, float]:
    """Adam-style ``betas``: two numbers, each in ``[0, 1)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{_where(owner, 'betas')} must be a list of two numbers in [0, 1), got {value!r}")
    return tuple(number(owner, f"betas[{i}]", b, low=0.0, high=1.0, high_open=True)
                 for i, b in enumerate(value))  # type: ignore[return-value]


def per_group(owner: str, key: str, value: Any, n_groups: int, check) -> list:
    """A scalar broadcast to every param group, or a list with one value per group; each value
    passes through ``check(owner, key, v)``."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{_where(owner, key)} has {len(value)} values but the optimizer has {n_groups} "
                f"param groups; give one value, or one per group"
            )
        return [check(owner, f"{key}[{i}]", v) for i, v in enumerate(value)]
    return [check(owner, key, value)] * n_groups
