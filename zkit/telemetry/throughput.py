"""Training speed over a sliding window of steps: samples/s, tokens/s, time per step."""
from __future__ import annotations

import collections
import math


class ThroughputMeter:
    """Rates over the last ``window`` optimizer steps.

    The caller times each step and reports it with :meth:`update`, so time spent outside
    training (evaluation, checkpoints) is simply not reported. Using a window rather than the
    whole run lets a slow first step (allocation, kernel compilation) fade out of the figures.
    """

    def __init__(self, window: int = 20) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError(f"ThroughputMeter window must be a positive integer, got {window!r}")
        self._window: collections.deque[tuple[float, int, int | None]] = collections.deque(maxlen=window)
        self.steps = 0
        self.total_samples = 0
        self.total_tokens = 0
        self.total_time_s = 0.0

    def update(self, samples: int, elapsed_s: float, tokens: int | None = None) -> None:
        """One step took ``elapsed_s`` seconds and consumed ``samples`` samples (and ``tokens``
        tokens, when the data has tokens), counted over all ranks for global throughput."""
        if samples < 0 or (tokens is not None and tokens < 0):
            raise ValueError(f"samples and tokens must be >= 0, got {samples} and {tokens}")
        if not math.isfinite(elapsed_s) or elapsed_s < 0:
            raise ValueError(f"step time must be a finite number of seconds >= 0, got {elapsed_s}")
        self._window.append((float(elapsed_s), int(samples), None if tokens is None else int(tokens)))
        self.steps += 1
        self.total_samples += samples
        self.total_tokens += tokens or 0
        self.total_time_s += elapsed_s

    def _elapsed(self) -> float:
        return sum(w[0] for w in self._window)

    @property
    def samples_per_s(self) -> float:
        elapsed = self._elapsed()
        return sum(w[1] for w in self._window) / elapsed if elapsed > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """``None`` when a step in the window reported no token count."""
        if not self._window or any(w[2] is None for w in self._window):
            return None
        elapsed = self._elapsed()
        return sum(w[2] for w in self._window) / elapsed if elapsed > 0 else 0.0

    @property
    def step_time_s(self) -> float:
        """Mean seconds per step over the window (0 before the first step)."""
        return self._elapsed() / len(self._window) if self._window else 0.0

    def metrics(self) -> dict[str, float]:
        """``samples_per_s``, ``step_time_s`` and, when known, ``tokens_per_s``: keys
        :func:`zkit.telemetry.format_step_line` renders with units."""
        out = {"samples_per_s": self.samples_per_s, "step_time_s": self.step_time_s}
        tokens = self.tokens_per_s
        if tokens is not None:
            out["tokens_per_s"] = tokens
        return out
