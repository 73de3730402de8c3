"""What the engine measures and shows while it trains: throughput, memory, the micro-step's
FLOPs and activations, the wall-clock breakdown, the periodic log lines and a progress bar.
Writing metrics to files (CSV, TensorBoard) is the built-in monitor plugin's job
(:mod:`zkit.monitor`). See docs/monitoring.md."""
from __future__ import annotations

from zkit.core.telemetry.format import format_bytes, format_flops, format_memory_line, format_step_line
from zkit.core.telemetry.memory import memory_snapshot
from zkit.core.telemetry.monitor import MetricsMonitor, NoMonitor
from zkit.core.telemetry.progress import ProgressBar, ProgressBarLogHandler, write_line
from zkit.core.telemetry.step_probe import StepProbe
from zkit.core.telemetry.throughput import ThroughputMeter

__all__ = [
    "MetricsMonitor",
    "NoMonitor",
    "ProgressBar",
    "ProgressBarLogHandler",
    "StepProbe",
    "ThroughputMeter",
    "format_bytes",
    "format_flops",
    "format_memory_line",
    "format_step_line",
    "memory_snapshot",
    "write_line",
]
