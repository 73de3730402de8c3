"""What a training run shows while it trains: throughput, memory, the micro-step's FLOPs and
activations, the wall-clock breakdown, the periodic step lines and a progress bar.

A built-in plugin (:mod:`zkit.telemetry.plugin`): the engine only calls the hooks
``zkit_phase``, ``zkit_model_pass`` and ``zkit_after_step``; what is measured and printed lives
here, with its state in the engine's stash (:func:`of`). Writing metrics to files (CSV,
TensorBoard) is the monitor plugin's job (:mod:`zkit.monitor`). See docs/monitoring.md."""
from __future__ import annotations

from zkit.core.memory import memory_snapshot
from zkit.telemetry.format import format_bytes, format_flops, format_memory_line, format_step_line
from zkit.telemetry.plugin import Telemetry, of
from zkit.telemetry.progress import ProgressBar, ProgressBarLogHandler, write_line
from zkit.telemetry.step_probe import StepProbe
from zkit.telemetry.throughput import ThroughputMeter

__all__ = [
    "ProgressBar",
    "ProgressBarLogHandler",
    "StepProbe",
    "Telemetry",
    "ThroughputMeter",
    "format_bytes",
    "format_flops",
    "format_memory_line",
    "format_step_line",
    "memory_snapshot",
    "of",
    "write_line",
]
