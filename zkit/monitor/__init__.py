"""What a training run shows and records: metric writers (CSV, TensorBoard), throughput, memory,
a progress bar, the engine's periodic log lines and the measurement of a micro-step's FLOPs and
activations. See docs/monitoring.md."""
from __future__ import annotations

from zkit.monitor.format import format_bytes, format_flops, format_memory_line, format_step_line
from zkit.monitor.memory import memory_snapshot
from zkit.monitor.progress import ProgressBar, ProgressBarLogHandler, write_line
from zkit.monitor.step_probe import StepProbe
from zkit.monitor.throughput import ThroughputMeter
from zkit.monitor.writers import CsvWriter, Monitor, TensorBoardWriter, log_dir

__all__ = [
    "CsvWriter",
    "Monitor",
    "ProgressBar",
    "ProgressBarLogHandler",
    "StepProbe",
    "TensorBoardWriter",
    "ThroughputMeter",
    "format_bytes",
    "format_flops",
    "format_memory_line",
    "format_step_line",
    "log_dir",
    "memory_snapshot",
    "write_line",
]
