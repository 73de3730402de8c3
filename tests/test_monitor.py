"""Monitoring: CSV and TensorBoard writers, throughput, memory, progress bar, step line."""
from __future__ import annotations

import csv
import io
import sys
import types

import attrs
import pytest
import torch

from zkit.telemetry import ProgressBar, ProgressBarLogHandler, ThroughputMeter, format_bytes, format_step_line, memory_snapshot, write_line
from zkit.monitor import Monitor
from zkit.monitor import writers


@attrs.define
class Section:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "job"


@attrs.define
class Config:
    csv_monitor: Section = attrs.Factory(Section)
    tensorboard: Section = attrs.Factory(Section)


def csv_config(tmp_path, job="run1"):
    return Config(csv_monitor=Section(True, str(tmp_path), job))


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


# -- Monitor / CSV -----------------------------------------------------------------------------


def test_csv_long_format(tmp_path):
    with Monitor(csv_config(tmp_path), rank=0) as monitor:
        assert monitor.enabled
        monitor.write_events([("Train/loss", 2.5, 1), ("Train/lr", 3e-4, 1)])
        monitor.write_events([("Train/loss", torch.tensor(2.25), 2), ("Train/skipped", 0, torch.tensor(2))])
    rows = read_rows(tmp_path / "run1" / "metrics.csv")
    assert rows == [
        ["step", "tag", "value"],
        ["1", "Train/loss", "2.5"],
        ["1", "Train/lr", "0.0003"],
        ["2", "Train/loss", "2.25"],
        ["2", "Train/skipped", "0.0"],
    ]


def test_csv_appends_without_repeating_the_header(tmp_path):
    for step in (1, 2):
        with Monitor(csv_config(tmp_path), rank=0) as monitor:
            monitor.write_events([("loss", float(step), step)])
    rows = read_rows(tmp_path / "run1" / "metrics.csv")
    assert rows == [["step", "tag", "value"], ["1", "loss", "1.0"], ["2", "loss", "2.0"]]


def test_csv_is_flushed_without_close(tmp_path):
    monitor = Monitor(csv_config(tmp_path), rank=0, flush_interval_s=0.0)
    monitor.write_events([("loss", float("nan"), 1)])
    assert read_rows(tmp_path / "run1" / "metrics.csv")[1] == ["1", "loss", "nan"]
    monitor.close()
    monitor.close()  # twice is fine


def test_only_rank_zero_writes(tmp_path):
    monitor = Monitor(csv_config(tmp_path), rank=1)
    assert not monitor.enabled
    monitor.write_events([("loss", 1.0, 1)])
    monitor.close()
    assert not (tmp_path / "run1").exists()


def test_disabled_or_missing_sections_write_nothing(tmp_path):
    assert not Monitor(Config(), rank=0).enabled
    assert not Monitor(types.SimpleNamespace(), rank=0).enabled


def test_empty_output_path_uses_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Monitor(Config(csv_monitor=Section(True, "", "j")), rank=0) as monitor:
        monitor.write_events([("loss", 1.0, 1)])
    assert (tmp_path / "j" / "metrics.csv").exists()


@pytest.mark.parametrize(
    "event, message",
    [
        (("loss", 1.0), r"a monitor event is a \(tag, value, step\) tuple, got \('loss', 1.0\)"),
        (("", 1.0, 1), "a monitor event's tag must be a non-empty string, got ''"),
        (("loss", 1.0, 1.5), "monitor event 'loss': step must be an integer, got 1.5"),
        (("loss", "high", 1), "monitor event 'loss': value must be a number, got 'high'"),
        (("loss", torch.ones(2), 1), r"monitor event 'loss': value must be a scalar, got a tensor of shape \(2,\)"),
    ],
)
def test_bad_events(tmp_path, event, message):
    with Monitor(csv_config(tmp_path), rank=0) as monitor:
        with pytest.raises(ValueError, match=message):
            monitor.write_events([event])


@pytest.mark.parametrize("job", ["", "/abs", "../outside"])
def test_bad_job_name(tmp_path, job):
    with pytest.raises(ValueError, match="monitor job_name must be a non-empty relative directory name"):
        Monitor(csv_config(tmp_path, job=job), rank=0)


def test_tensorboard_missing_package_says_what_to_install(tmp_path, monkeypatch):
    real = writers.importlib.util.find_spec
    monkeypatch.setattr(writers.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    config = Config(tensorboard=Section(True, str(tmp_path), "tb"))
    with pytest.raises(ImportError, match="'tensorboard' package is not installed: pip install tensorboard"):
        Monitor(config, rank=0)
    Monitor(config, rank=1)  # other ranks never open a writer


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Monitor(Config(tensorboard=Section(True, str(tmp_path), "tb")), rank=0) as monitor:
        monitor.write_events([("Train/loss", 2.0, 1), ("Train/loss", 1.5, 2)])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("Train/loss")] == [(1, 2.0), (2, 1.5)]


# -- throughput, memory, formatting ------------------------------------------------------------


def test_throughput_window():
    meter = ThroughputMeter(window=2)
    assert meter.metrics() == {"samples_per_s": 0.0, "step_time_s": 0.0}
    meter.update(8, 10.0, tokens=800)  # slow first step, leaves the window
    meter.update(8, 0.5, tokens=800)
    meter.update(8, 1.5, tokens=800)
    assert meter.samples_per_s == pytest.approx(16 / 2.0)
    assert meter.tokens_per_s == pytest.approx(1600 / 2.0)
    assert meter.step_time_s == pytest.approx(1.0)
    assert (meter.steps, meter.total_samples, meter.total_tokens, meter.total_time_s) == (3, 24, 2400, 12.0)
    meter.update(8, 1.0)  # no token count: tokens/s is unknown rather than wrong
    assert "tokens_per_s" not in meter.metrics()


def test_throughput_errors():
    with pytest.raises(ValueError, match="ThroughputMeter window must be a positive integer, got 0"):
        ThroughputMeter(window=0)
    with pytest.raises(ValueError, match="step time must be a finite number of seconds >= 0, got -1"):
        ThroughputMeter().update(1, -1)
    with pytest.raises(ValueError, match="samples and tokens must be >= 0, got -1 and None"):
        ThroughputMeter().update(-1, 1.0)


def test_memory_snapshot():
    snap = memory_snapshot({"param": {"live": 100, "peak": 200}, "grad": {"live": 0, "peak": 50}})
    assert snap["rss_bytes"] > 10 * 2**20 and snap["peak_rss_bytes"] >= snap["rss_bytes"]
    assert snap["param_bytes"] == 100 and snap["param_peak_bytes"] == 200 and snap["grad_peak_bytes"] == 50
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    assert memory_snapshot()["rss_bytes"] >= snap["rss_bytes"] + 32 * 2**20
    del block


def test_format_step_line():
    line = format_step_line(
        20,
        {
            "total_steps": 200,
            "step_time_s": 0.0412,
            "loss": 2.31449,
            "lr": 3e-4,
            "tokens_per_s": 5120.4,
            "rss_per_rank": [512 * 2**20, 508 * 2**20],
            "skipped": 0,
            "grad_norm": None,
        },
    )
    assert line == "step 20/200 | loss 2.314 | lr 3.0e-04 | 5,120 tok/s | 41 ms/step | rss r0 512 MiB r1 508 MiB | skipped 0"
    assert format_step_line(3, {}) == "step 3"


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 10 * 2**20, 512 * 2**20, 3.5 * 2**30)] == [
        "0 B", "1023 B", "1.5 KiB", "10 MiB", "512 MiB", "3.5 GiB",
    ]


# -- progress bar ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_bar_non_tty_prints_plain_lines_periodically():
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(100, desc="train", file=out, plain_interval_s=10.0, clock=clock)
    for _ in range(50):
        clock.now += 0.5
        bar.update(1, loss=2.5)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines == [
        "train 20/100 (20%) | 2.00 it/s | elapsed 00:10 | eta 00:40 | loss=2.5",
        "train 40/100 (40%) | 2.00 it/s | elapsed 00:20 | eta 00:30 | loss=2.5",
        "train 50/100 (50%) | 2.00 it/s | elapsed 00:25 | eta 00:25 | loss=2.5",
    ]


def test_progress_bar_tty_redraws_in_place():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, clock = Tty(), FakeClock()
    bar = ProgressBar(10, desc="train", file=out, clock=clock)
    clock.now = 1.0
    bar.update(5, loss=1.25)
    write_line("step 5 | loss 1.25", out)
    bar.close()
    text = out.getvalue()
    assert text.count("\r\x1b[K") >= 3 and text.endswith("\n")
    assert "\r\x1b[Kstep 5 | loss 1.25\n" in text  # the log line replaced the bar, then the bar came back
    final = text.rsplit("\r\x1b[K", 1)[1]
    assert final.startswith("train  50%|") and "5/10 [00:01<00:01, 5.00 it/s, loss=1.25]" in final
    assert bar.render(width=60).startswith("train  50%|")
    assert len(bar.render(width=60)) <= 60


def test_progress_bar_disabled_and_unknown_total():
    out = io.StringIO()
    bar = ProgressBar(10, file=out, enabled=False)
    bar.update(3)
    bar.close()
    assert out.getvalue() == ""
    clock = FakeClock()
    bar = ProgressBar(None, desc="eval", file=out, clock=clock)
    clock.now = 2.0
    bar.update(4)
    assert bar.plain_line() == "eval 4 | 2.00 it/s | elapsed 00:02"
    with pytest.raises(ValueError, match="ProgressBar total must be >= 0 or None, got -1"):
        ProgressBar(-1)


def test_log_handler_goes_through_write_line(monkeypatch):
    import logging

    out = io.StringIO()
    logger = logging.getLogger("zkit.test_monitor")
    handler = ProgressBarLogHandler(out)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("step 1 | loss 2")
    finally:
        logger.removeHandler(handler)
    assert out.getvalue() == "step 1 | loss 2\n"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    write_line("plain")
    assert sys.stderr.getvalue() == "plain\n"
