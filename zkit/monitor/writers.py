"""Metric writers: a long-format CSV file and TensorBoard, behind one :class:`Monitor`.

The engine hands every metric to ``Monitor.write_events([(tag, value, step), ...])`` - DeepSpeed's
monitor API - and the monitor fans the events out to each enabled writer. Only rank 0 writes: on
other ranks the monitor is a no-op, so callers need no rank checks.

Both writers put their files in ``<output_path>/<job_name>/``: the CSV writer a single
``metrics.csv`` with the columns ``step,tag,value``, TensorBoard its event files. An empty
``output_path`` means the current directory for CSV and ``runs`` for TensorBoard.
"""
from __future__ import annotations

import csv
import importlib.util
import math
import operator
import os
import time
from typing import Any, Iterable, Protocol

import torch

#: where each writer puts its directory when ``output_path`` is empty
DEFAULT_OUTPUT_PATH = {"csv_monitor": ".", "tensorboard": "runs"}
CSV_FILENAME = "metrics.csv"
CSV_COLUMNS = ("step", "tag", "value")

Event = tuple[str, float, int]


class MonitorSection(Protocol):
    """What a writer reads from its config section (``csv_monitor``, ``tensorboard``)."""

    enabled: bool
    output_path: str
    job_name: str


def log_dir(section: MonitorSection, default_output_path: str = ".") -> str:
    """``<output_path>/<job_name>``: where a writer configured by ``section`` puts its files."""
    job = (section.job_name or "").strip()
    if not job or os.path.isabs(job) or ".." in job.replace("\\", "/").split("/"):
        raise ValueError(
            f"monitor job_name must be a non-empty relative directory name, got {section.job_name!r}"
        )
    return os.path.join(section.output_path or default_output_path, job)


def _check_events(events: Iterable[Event]) -> list[tuple[str, float, int]]:
    checked = []
    for event in events:
        try:
            tag, value, step = event
        except (TypeError, ValueError):
            raise ValueError(f"a monitor event is a (tag, value, step) tuple, got {event!r}") from None
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a monitor event's tag must be a non-empty string, got {tag!r}")
        try:
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)  # int, numpy integer, integer tensor
        except TypeError:
            raise ValueError(f"monitor event {tag!r}: step must be an integer, got {step!r}") from None
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"monitor event {tag!r}: value must be a scalar, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"monitor event {tag!r}: value must be a number, got {value!r}") from None
        checked.append((tag, value, step))
    return checked


class CsvWriter:
    """Appends events to ``<log_dir>/metrics.csv`` (header written once, when the file is new).

    Rows reach the OS with the first write ``flush_interval_s`` seconds or more after the previous
    flush, and on :meth:`close`, so a crashed run loses only its last rows. Appending keeps the rows
    of earlier runs of the same job (a resumed run continues the same file).
    """

    def __init__(self, directory: str, flush_interval_s: float = 5.0) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, CSV_FILENAME)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._file)
        if self._file.tell() == 0:
            self._csv.writerow(CSV_COLUMNS)
        self.flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()

    def write(self, events: list[Event]) -> None:
        self._csv.writerows((step, tag, repr(value) if math.isfinite(value) else str(value)) for tag, value, step in events)
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval_s:
            self.flush()
            self._last_flush = now

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardWriter:
    """Scalars through :class:`torch.utils.tensorboard.SummaryWriter` (needs ``tensorboard``)."""

    def __init__(self, directory: str, flush_interval_s: float = 5.0) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "the tensorboard monitor is enabled in the config but the 'tensorboard' package is not "
                "installed: pip install tensorboard (or pip install 'zkit[tensorboard]'), or set "
                '"tensorboard": {"enabled": false}'
            )
        from torch.utils.tensorboard import SummaryWriter

        self.path = directory
        self._writer = SummaryWriter(log_dir=directory, flush_secs=max(1, int(flush_interval_s)))

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Monitor:
    """Every enabled metric writer of a config, on rank 0.

    ``config`` is the engine's config; its ``csv_monitor`` and ``tensorboard`` sections (each with
    ``enabled``, ``output_path``, ``job_name``) say which writers to open. A missing section counts
    as disabled.
    """

    def __init__(self, config: Any, rank: int = 0, flush_interval_s: float = 5.0) -> None:
        self.rank = rank
        self.writers: list[CsvWriter | TensorBoardWriter] = []
        if rank != 0:
            return
        csv_section = getattr(config, "csv_monitor", None)
        tb_section = getattr(config, "tensorboard", None)
        if csv_section is not None and csv_section.enabled:
            self.writers.append(CsvWriter(log_dir(csv_section, DEFAULT_OUTPUT_PATH["csv_monitor"]), flush_interval_s))
        if tb_section is not None and tb_section.enabled:
            self.writers.append(TensorBoardWriter(log_dir(tb_section, DEFAULT_OUTPUT_PATH["tensorboard"]), flush_interval_s))

    @property
    def enabled(self) -> bool:
        """Whether this process writes anything."""
        return bool(self.writers)

    def write_events(self, events: Iterable[Event]) -> None:
        """Record ``(tag, value, step)`` events; values may be floats, ints or scalar tensors."""
        if not self.writers:
            return
        checked = _check_events(events)
        for writer in self.writers:
            writer.write(checked)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer (safe to call twice)."""
        for writer in self.writers:
            writer.close()
        self.writers = []

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
