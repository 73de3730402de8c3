"""``engine.tput_timer``: DeepSpeed's throughput counters of one engine (its ``ThroughputTimer``),
read from zkit's engine (steps) and its telemetry (time per step), so there is one clock."""
from __future__ import annotations

from typing import Any

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """The counters DeepSpeed's engine keeps in ``tput_timer``: ``epoch_count`` (advanced by
    :meth:`update_epoch_count`, as DeepSpeed-Chat does at each epoch's end),
    ``micro_step_count`` (micro-steps since the epoch began), ``global_step_count``,
    ``batch_size`` (the global batch) and :meth:`avg_samples_per_sec`."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.batch_size = engine.train_batch_size()
        self.epoch_count = 0
        self._epoch_first_micro_step = engine.micro_steps

    @property
    def global_step_count(self) -> int:
        return self._engine.global_steps

    @property
    def micro_step_count(self) -> int:
        return self._engine.micro_steps - self._epoch_first_micro_step

    def update_epoch_count(self) -> None:
        """An epoch ended: count it and start the micro-step count again."""
        self.epoch_count += 1
        self._epoch_first_micro_step = self._engine.micro_steps

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the steps taken so far (``-inf`` before the first, as DeepSpeed
        answers), from zkit's telemetry; ``-inf`` too where the telemetry plugin is blocked."""
        from zkit.telemetry import of

        try:
            meter = of(self._engine).throughput
        except KeyError:
            return float("-inf")
        return meter.total_samples / meter.total_time_s if meter.total_time_s > 0 else float("-inf")
