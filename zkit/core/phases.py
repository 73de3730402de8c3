"""What this rank is doing, by name: the engine's phases (``forward``, ``backward``,
``optimizer.step``, ``save_checkpoint``...) and the partitioner's work inside them (``reduce
'layers.3.mlp'``). A communicator stamps each collective with :func:`current_phase`, so a failure
report says where every rank was; while a profiler records, each phase is also a range in its
trace (:mod:`zkit.core.profiling`)."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from zkit.core.profiling import span


class _Phase(threading.local):
    stack: list[str]

    def __init__(self) -> None:
        self.stack = []


_PHASE = _Phase()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Name what this rank is doing (nested names are joined with ': '); while a profiler records,
    the phase is also a range in its trace (:mod:`zkit.core.profiling`)."""
    _PHASE.stack.append(name)
    try:
        with span(name):
            yield
    finally:
        _PHASE.stack.pop()


def current_phase() -> str:
    return ": ".join(_PHASE.stack) or "user code"
