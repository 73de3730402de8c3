"""Built-in plugin: metric writers (CSV, TensorBoard, Weights & Biases) behind ``engine.monitor``,
configured by the ``csv_monitor`` / ``tensorboard`` / ``wandb`` sections. See docs/monitoring.md."""
from __future__ import annotations

from zkit.monitor.writers import CsvWriter, Monitor, TensorBoardWriter, log_dir

__all__ = ["CsvWriter", "Monitor", "TensorBoardWriter", "log_dir"]
