"""The built-in telemetry plugin: times the engine's phases, measures the first micro-step, and
logs a step line and a memory line every ``steps_per_print`` steps (and every step with
``memory_breakdown``), which it also hands to ``engine.monitor``.

Its per-engine state is a :class:`Telemetry` in the engine's stash; :func:`of` returns it.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import torch

import zkit
from zkit.core.records import ConfigSectionRecord
from zkit.core.stash import StashKey
from zkit.telemetry.config import FlopsProfilerConfig
from zkit.telemetry.format import format_memory_line, format_step_line
from zkit.telemetry.progress import ProgressBarLogHandler
from zkit.telemetry.step_probe import StepProbe
from zkit.telemetry.throughput import ThroughputMeter
from zkit.telemetry.wall_clock import WallClock

log = logging.getLogger("zkit")


@attrs.define
class Telemetry:
    """What the plugin keeps per engine."""

    wall_clock: WallClock
    throughput: ThroughputMeter
    #: FLOPs and saved activations of the first training micro-step, for the step line
    step_probe: StepProbe
    step_started: float = attrs.field(factory=time.perf_counter)


TELEMETRY = StashKey[Telemetry]()


def of(engine: Any) -> Telemetry:
    """The telemetry of ``engine`` (KeyError when the plugin is blocked)."""
    return engine.stash[TELEMETRY]


def _setup_logging(rank: int) -> None:
    """Show zkit's step lines on rank 0 unless the application configured logging itself."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = ProgressBarLogHandler()  # keeps a live progress bar intact on a terminal
    handler.setFormatter(logging.Formatter("[zkit] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    yield ConfigSectionRecord(path="flops_profiler", schema=FlopsProfilerConfig, description="FLOPs profiler.",
                              default_when_absent=True)


@zkit.hookimpl(tryfirst=True)
def zkit_engine_setup(engine):
    # first: every other plugin's set-up may log
    _setup_logging(engine.rank)
    engine.stash[TELEMETRY] = Telemetry(
        WallClock(engine.config.wall_clock_breakdown, engine.device), ThroughputMeter(), StepProbe(engine.module)
    )


@zkit.hookimpl(trylast=True)
def zkit_phase(engine, phase):
    return of(engine).wall_clock.time(phase)


@zkit.hookimpl(trylast=True)
def zkit_model_pass(engine, direction):
    probe = of(engine).step_probe
    return probe.forward() if direction == "forward" else probe.backward()


@zkit.hookimpl(trylast=True)
def zkit_after_step(engine, losses):
    state = of(engine)
    now = time.perf_counter()
    elapsed, state.step_started = now - state.step_started, now
    state.wall_clock.end_step()
    samples = engine.train_batch_size()
    per_sample = engine.tokens_per_sample
    state.throughput.update(samples, elapsed, tokens=samples * per_sample if per_sample else None)
    every = engine.config.steps_per_print
    if (every and engine.global_steps % every == 0) or engine.config.memory_breakdown:
        # the loss's value only now: reading it every step would wait for the device every step
        loss = torch.stack(list(losses)).mean().item() if losses else float("nan")
        _log_step(engine, state, loss)


def _log_step(engine: Any, state: Telemetry, loss: float) -> None:
    mem = engine.memory()
    mem["buffers_bytes"] = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    probe = state.step_probe
    if probe.activation_bytes is not None:
        mem["activations_peak_bytes"] = probe.activation_bytes
    all_mem = engine.comm.all_gather_object(mem) if engine.world_size > 1 else [mem]
    throughput = state.throughput.metrics()
    metrics = {
        **state.wall_clock.take(),
        "loss": loss,
        "lr": engine.get_lr()[0] if engine.optimizer.param_groups else 0.0,
        **throughput,
        **probe.metrics(throughput["step_time_s"], engine.gradient_accumulation_steps()),
        "rss_per_rank": [m.get("rss_bytes", 0) for m in all_mem],
        "total_steps": getattr(engine.lr_scheduler, "total_num_steps", None),
    }
    if engine.loss_scaler.enabled:
        metrics["loss_scale"] = engine.loss_scaler.scale
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm
    if engine.rank == 0:
        log.info(format_step_line(engine.global_steps, metrics))
        log.info(format_memory_line(all_mem))
        engine.monitor.write_events(
            [(f"Train/{k}", float(v), engine.global_steps) for k, v in metrics.items() if isinstance(v, (int, float))]
        )
