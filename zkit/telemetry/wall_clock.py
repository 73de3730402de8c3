"""``wall_clock_breakdown``: where a step's time goes, as DeepSpeed's timers report it.

The engine times its forward, backward (with the gradient reduction it overlaps) and optimizer
step; the step log line gains ``forward_ms``, ``backward_ms`` and ``step_ms``: per global batch (its micro-steps summed),
averaged over the batches since the last line. On an accelerator each interval ends with a device synchronisation, so
the figures are the device's, at the cost of the overlap a synchronisation removes: switch it on to
look, not for production runs (DeepSpeed's caveat too).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch


class WallClock:
    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.sync = enabled and device.type != "cpu"
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.totals[name] += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.sync:
            torch.accelerator.synchronize(self.device)

    def end_step(self) -> None:
        self.steps += 1

    def take(self) -> dict[str, float]:
        """``{"forward_ms": ..., ...}`` per global batch since the last call (empty when off)."""
        steps = max(self.steps, 1)
        out = {f"{name}_ms": seconds * 1000 / steps for name, seconds in self.totals.items()}
        self.totals.clear()
        self.steps = 0
        return out
