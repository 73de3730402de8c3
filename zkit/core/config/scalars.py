"""Numbers of a config built in Python that are not Python numbers: a NumPy scalar (``np.float32(1e-3)``,
what a sweep's ``np.logspace`` yields) or a 0-d tensor. DeepSpeed accepts them; at the config's edge
they become the ``bool``, ``int`` or ``float`` they hold, so every check and every consumer sees plain
numbers. Arrays and tensors with elements are left alone (and refused by the checks that see them)."""
from __future__ import annotations

from typing import Any


def plain_scalars(value: Any) -> Any:
    """``value`` with every NumPy scalar, 0-d NumPy array and 0-d tensor inside dicts, lists and
    tuples replaced by the Python number it holds."""
    if isinstance(value, dict):
        return {k: plain_scalars(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain_scalars(v) for v in value)
    return _python_number(value)


def _python_number(value: Any) -> Any:
    kind = type(value).__module__.split(".")[0]
    if kind == "numpy" and getattr(value, "ndim", None) == 0 and value.dtype.kind in "biuf":
        return value.item()
    if kind == "torch" and getattr(value, "ndim", None) == 0 and not value.is_complex():
        return value.item()  # a tensor's item() is a bool, int or float by its dtype
    return value
