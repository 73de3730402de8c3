"""The one-line training report the engine prints every ``steps_per_print`` steps::

    step 20/200 | loss 2.314 | lr 3.0e-04 | 5,120 tok/s | 41 ms/step | rss r0 512 MiB r1 508 MiB
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``1536 -> "1.5 KiB"``; MiB and above without decimals once past 100."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"


def format_number(value: Any) -> str:
    """Compact form for an unknown metric: 4 significant digits for floats."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _per_rank(label: str, values: Sequence[float]) -> str:
    return label + " " + " ".join(f"r{r} {format_bytes(v)}" for r, v in enumerate(values))


# Known metrics, in the order they are printed: key -> how to render the value.
_KNOWN: list[tuple[str, Callable[[Any], str]]] = [
    ("loss", lambda v: f"loss {v:.4g}"),
    ("val_loss", lambda v: f"val_loss {v:.4g}"),
    ("lr", lambda v: f"lr {v:.1e}"),
    ("grad_norm", lambda v: f"grad_norm {v:.3g}"),
    ("loss_scale", lambda v: f"loss_scale {v:g}"),
    ("tokens_per_s", lambda v: f"{v:,.0f} tok/s"),
    ("samples_per_s", lambda v: f"{v:,.1f} samples/s"),
    ("step_time_s", lambda v: f"{v * 1000:,.0f} ms/step"),
    ("rss_bytes", lambda v: f"rss {format_bytes(v)}"),
    ("rss_per_rank", lambda v: _per_rank("rss", v)),
    ("cuda_allocated_per_rank", lambda v: _per_rank("cuda", v)),
]
_SPECIAL = {"total_steps"} | {key for key, _ in _KNOWN}


def format_step_line(step: int, metrics: Mapping[str, Any]) -> str:
    """``"step S/T | ..."`` from ``metrics``.

    Known keys (``total_steps``, ``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``loss_scale``,
    ``tokens_per_s``, ``samples_per_s``, ``step_time_s``, ``rss_bytes``, and the per-rank lists
    ``rss_per_rank``, ``cuda_allocated_per_rank`` in bytes) are printed in that order with their
    units; any other key follows as ``"key value"``. ``None`` values are left out.
    """
    total = metrics.get("total_steps")
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for key, render in _KNOWN:
        value = metrics.get(key)
        if value is not None:
            parts.append(render(value))
    for key, value in metrics.items():
        if key not in _SPECIAL and value is not None:
            parts.append(f"{key} {format_number(value)}")
    return " | ".join(parts)
