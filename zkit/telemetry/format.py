"""The training report the engine prints every ``steps_per_print`` steps: a step line and a
per-rank memory line::

    step 20/200 | loss 2.314 | lr 3.0e-04 | 5,120 tok/s | 41 ms/step | 3.21 TFLOP/step | 78.3 TFLOP/s per rank | rss r0 512 MiB r1 508 MiB
    mem r0 params 12 MiB grads 12 MiB optim 48 MiB master 24 MiB buffers 4 KiB activations 96 MiB | r1 ...
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


_FLOP_UNITS = ("", "K", "M", "G", "T", "P", "E")


def format_flops(n: float) -> str:
    """``3.2e12 -> "3.2 TFLOP"``: three significant digits, decimal prefixes."""
    value = float(n)
    for unit in _FLOP_UNITS:
        if abs(value) < 1000 or unit == _FLOP_UNITS[-1]:
            break
        value /= 1000
    return f"{value:.3g} {unit}FLOP"


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
    ("step_flops", lambda v: f"{format_flops(v)}/step"),
    ("flops_per_s", lambda v: f"{format_flops(v)}/s per rank"),
    ("rss_bytes", lambda v: f"rss {format_bytes(v)}"),
    ("rss_per_rank", lambda v: _per_rank("rss", v)),
    ("cuda_allocated_per_rank", lambda v: _per_rank("cuda", v)),
]
_SPECIAL = {"total_steps"} | {key for key, _ in _KNOWN}


def format_step_line(step: int, metrics: Mapping[str, Any]) -> str:
    """``"step S/T | ..."`` from ``metrics``.

    Known keys (``total_steps``, ``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``loss_scale``,
    ``tokens_per_s``, ``samples_per_s``, ``step_time_s``, ``step_flops`` and ``flops_per_s`` (one
    rank's FLOPs per optimizer step, and achieved per second), ``rss_bytes``, and the per-rank lists
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


#: memory line fields: snapshot key -> label. Gradients and buckets exist only while a batch runs
#: (handed back after the step), so their figure is the peak, not what is held at the log line.
MEMORY_FIELDS = (
    ("param_bytes", "params"),
    ("grad_peak_bytes", "grads"),
    ("optim_state_bytes", "optim"),
    ("optim_state_nvme_bytes", "optim_nvme"),
    ("param_nvme_bytes", "params_nvme"),
    ("master_bytes", "master"),
    ("master_grad_bytes", "master_grads"),
    ("bucket_peak_bytes", "buckets"),
    ("buffers_bytes", "buffers"),
    ("activation_bytes", "ckpt_inputs"),
    ("activations_peak_bytes", "activations"),
)
#: above this many ranks the memory line shows rank 0 and the largest figure of each field
MAX_RANKS_LISTED = 4


def _memory_fields(snapshot: Mapping[str, Any]) -> str:
    return " ".join(f"{label} {format_bytes(snapshot[key])}" for key, label in MEMORY_FIELDS if snapshot.get(key))


def format_memory_line(per_rank: Sequence[Mapping[str, Any]]) -> str:
    """``"mem r0 params 12 MiB grads 12 MiB ... | r1 ..."`` from each rank's memory snapshot
    (:func:`zkit.monitor.memory_snapshot` keys plus ``buffers_bytes`` and
    ``activations_peak_bytes``). Fields that are zero or absent are left out. With more than
    :data:`MAX_RANKS_LISTED` ranks: rank 0, then ``max`` with the largest value of each field
    over all ranks and the rank holding it."""
    if len(per_rank) <= MAX_RANKS_LISTED:
        return "mem " + " | ".join(f"r{r} {_memory_fields(m)}".rstrip() for r, m in enumerate(per_rank))
    largest = []
    for key, label in MEMORY_FIELDS:
        rank = max(range(len(per_rank)), key=lambda r: per_rank[r].get(key) or 0)
        if per_rank[rank].get(key):
            largest.append(f"{label} {format_bytes(per_rank[rank][key])} (r{rank})")
    return f"mem r0 {_memory_fields(per_rank[0])} | max over {len(per_rank)} ranks " + " ".join(largest)
