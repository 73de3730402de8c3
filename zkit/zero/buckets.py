"""Gradient bucketing shared by the stages: launch one collective per unit as soon as all of the
unit's gradients are ready during backward, so communication overlaps the rest of backward.

Collectives must be issued in the same order on every rank, or they pair up wrongly. Units are
launched strictly in index order (unit ``i`` waits for units ``< i`` to launch), and the units are laid
out in reverse parameter order, which is the order backward produces gradients in; so in the usual
case each unit launches the moment its last gradient arrives.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

from zkit.core import phases
from zkit.core.communicator import Handle


class GradientBucketer:
    """Counts ready gradients per unit and launches/finishes the unit's reduction.

    ``launch(unit) -> Handle | None`` starts the unit's collective; ``finish(unit)`` runs after it
    completed (copy out, accumulate, release scratch). ``max_in_flight`` bounds the number of
    unfinished collectives (each may hold a scratch bucket); ``0`` means unbounded. ``fits(unit)``,
    when given, says whether the unit's scratch fits beside the collectives in flight; the oldest
    ones are finished until it does.
    """

    def __init__(
        self,
        params_per_unit: Sequence[int],
        launch: Callable[[int], Handle | None],
        finish: Callable[[int], None],
        max_in_flight: int = 0,
        names: Sequence[str] | None = None,
        fits: Callable[[int], bool] | None = None,
    ) -> None:
        self.sizes = list(params_per_unit)
        self.launch = launch
        self.finish = finish
        self.max_in_flight = max_in_flight
        self.fits = fits
        self.names = list(names) if names is not None else [f"unit {i}" for i in range(len(self.sizes))]
        self.pending: list[int] = []
        self.next = 0
        self.in_flight: deque[tuple[int, Any]] = deque()
        self.reset()

    def reset(self) -> None:
        self.pending = list(self.sizes)
        self.next = 0

    def ready(self, unit: int) -> None:
        """One gradient of ``unit`` is final for this backward."""
        self.pending[unit] -= 1
        if self.pending[unit] == 0:
            self._launch_in_order()

    def _launch_in_order(self, force: bool = False) -> None:
        while self.next < len(self.sizes) and (force or self.pending[self.next] <= 0):
            if self.max_in_flight and len(self.in_flight) >= self.max_in_flight:
                self._complete_oldest()
            while self.fits is not None and self.in_flight and not self.fits(self.next):
                self._complete_oldest()
            with phases.phase(f"reduce {self.names[self.next]}"):
                handle = self.launch(self.next)
            if handle is None and not self.in_flight:
                # nothing in flight (one replica): finished now, not when the next unit launches,
                # so what waits for the unit (a step in backward) does not wait for the next one
                self.finish(self.next)
            else:
                self.in_flight.append((self.next, handle))
            self.next += 1

    def _complete_oldest(self) -> None:
        unit, handle = self.in_flight.popleft()
        if handle is not None:
            handle.wait()
        self.finish(unit)

    def flush(self) -> None:
        """End of backward: launch every unit not launched yet (some parameters may have had no
        gradient this time), then wait for all of them."""
        self._launch_in_order(force=True)
        while self.in_flight:
            self._complete_oldest()
        self.reset()


class ScratchRing:
    """Scratch for reductions in flight, carved in launch order from ``count`` segments of
    ``segment`` elements and handed back oldest first (the order :class:`GradientBucketer`
    finishes them). A region lies within one segment, so each segment can be a buffer of its own.

    Units of different sizes share the segments, so as many small units are in flight as fit where
    ``count`` buckets of the largest unit would: stage 3's per-module units (a few hundred thousand
    elements beside an embedding of millions) keep the link busy without more memory.
    """

    def __init__(self, segment: int, count: int = 1) -> None:
        self.segment, self.count = segment, count
        self.size = segment * count
        self.regions: deque[tuple[int, int]] = deque()  # (start, numel), oldest first

    def _aligned(self, start: int, numel: int) -> int:
        """``start``, or the next segment's start if the region would cross into it."""
        if start // self.segment != (start + numel - 1) // self.segment:
            return (start // self.segment + 1) * self.segment
        return start

    def _place(self, numel: int) -> int | None:
        if numel > self.segment:
            raise ValueError(f"a unit of {numel} elements does not fit a scratch segment of {self.segment}")
        if not self.regions:
            return 0
        tail = self.regions[0][0]
        head = self.regions[-1][0] + self.regions[-1][1]
        if self.regions[-1][0] >= tail:  # not wrapped: free space after head, then before tail
            start = self._aligned(head, numel)
            if start + numel <= self.size:
                return start
            return 0 if numel <= tail else None
        start = self._aligned(head, numel)  # wrapped: free space between head and tail
        return start if start + numel <= tail else None

    def fits(self, numel: int) -> bool:
        return self._place(numel) is not None

    def take(self, numel: int) -> tuple[int, int, int]:
        """Reserve ``numel`` elements: ``(segment, start, end)`` of the region within its segment
        (the caller checked :meth:`fits`)."""
        start = self._place(numel)
        if start is None:
            raise RuntimeError(f"no room for {numel} elements in the scratch ring: finish the oldest first")
        self.regions.append((start, numel))
        seg = start // self.segment
        return seg, start - seg * self.segment, start - seg * self.segment + numel

    def give_back(self) -> None:
        """The oldest region is free again."""
        self.regions.popleft()
