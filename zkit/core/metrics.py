"""What the engine needs from the object behind ``engine.monitor`` (see the hook
``zkit_make_monitor``)."""
from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

#: ``(tag, value, step)``; the value a float, an int or a scalar tensor
Event = tuple[str, Any, int]


@runtime_checkable
class MetricsMonitor(Protocol):
    """Receives metric events; ``close`` flushes and is safe to call twice."""

    @property
    def enabled(self) -> bool:
        """Whether this process writes anything."""

    def write_events(self, events: Iterable[Event]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NoMonitor:
    """``engine.monitor`` when no plugin answers ``zkit_make_monitor``: writes nothing."""

    enabled = False

    def write_events(self, events: Iterable[Event]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
