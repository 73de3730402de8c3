"""Host<->device copies off the compute stream: a side stream, one event per copy, a bounded
number of copies in flight. The built-in allocators' :class:`zkit.core.copies.Copies`
(``allocator.copies``).

Offload moves gradients to the host master, updated weights back and stage-3 shards to the
device. :meth:`CopyQueue.copy` issues such a copy on a side stream after an event recorded on the
compute stream (the copy reads what compute wrote), records an event after it and returns a
:class:`StreamCopy` whose :meth:`~StreamCopy.wait` orders the consumer after that event: a device
consumer makes the compute stream wait (no host synchronisation), a host consumer synchronises on
it. At most ``max_in_flight`` copies are outstanding; issuing one more first waits, on the host,
for the oldest. The queue keeps each copy's tensors referenced until its event has completed, so
memory that another stream still reads is never handed back early.

Copies whose two ends are in the same memory (every copy of a CPU-only run) are a plain
``copy_`` on the caller's thread that returns :data:`zkit.core.copies.DONE`: no stream, no event,
no synchronisation. The streams come from torch's device-generic API (``torch.Stream``,
``torch.Event``, ``torch.accelerator``), so the same code serves CUDA and any other accelerator
torch supports.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Iterator, Protocol

import torch

from zkit.core.copies import DONE, Copy


class Streams(Protocol):
    """Where copies run: the accelerator's streams and events (a fake one in tests)."""

    def crosses(self, a: torch.device, b: torch.device) -> bool:
        """Whether a copy between ``a`` and ``b`` moves between host and device memory."""

    def current(self) -> Any:
        """The calling thread's current (compute) stream."""

    def new_stream(self) -> Any:
        """A new stream (with ``wait_event(event)``)."""

    def new_event(self) -> Any:
        """A new event (with ``record(stream)``, ``query()`` and ``synchronize()``)."""

    def using(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` the current stream inside the block."""


class AcceleratorStreams:
    """:class:`Streams` of torch's current accelerator for ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def crosses(self, a: torch.device, b: torch.device) -> bool:
        return a.type != b.type

    def current(self) -> Any:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device)

    def new_event(self) -> Any:
        return torch.Event(device=self.device)

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[None]:
        previous = self.current()
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)


def default_streams(device: torch.device) -> Streams | None:
    """The streams copies to and from ``device`` use: ``None`` (plain copies) unless ``device`` is
    an accelerator that is present."""
    if device.type == "cpu" or device.type == "meta" or not torch.accelerator.is_available():
        return None
    return AcceleratorStreams(device)


class StreamCopy:
    """One copy a :class:`CopyQueue` issued on its side stream; :meth:`wait` before using its
    destination (a :class:`zkit.core.copies.Copy`)."""

    __slots__ = ("dst", "src", "event", "queue")

    def __init__(self, dst: torch.Tensor | None, src: torch.Tensor | None, event: Any,
                 queue: "CopyQueue | None") -> None:
        self.dst, self.src, self.event, self.queue = dst, src, event, queue

    def wait(self) -> None:
        """Order the destination's consumer after the copy: the compute stream waits for a device
        destination, the host for a host one."""
        if self.event is None:
            return
        if self.dst.device.type == "cpu":
            self.synchronize()
        else:
            self.queue.streams.current().wait_event(self.event)

    def hold_source(self) -> None:
        """Make the current (compute) stream wait for the copy before it runs what is issued next,
        so the source may be written again at once, without a wait on the host (a bucket that
        the next unit's gradients reuse)."""
        if self.event is not None:
            self.queue.streams.current().wait_event(self.event)

    def synchronize(self) -> None:
        """Wait on the host until the copy is done (its source may then be overwritten)."""
        if self.event is not None:
            self.event.synchronize()
            self.retire()

    def retire(self) -> None:
        """The copy is known to be done: let go of its tensors. A unit keeps its last copy, and a
        source held past its copy (a gathered buffer written back to a host shard) would keep a
        whole model's buffers on the device."""
        self.dst = self.src = self.event = None


class CopyQueue:
    """Copies between host and ``device`` memory on a side stream (see the module docstring).

    Args:
        device: the training device.
        max_in_flight: copies outstanding at most; must be at least 1.
        streams: where copies run; default :func:`default_streams` (``None`` on a CPU-only run).
    """

    def __init__(self, device: torch.device | str, max_in_flight: int = 4, streams: Streams | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"CopyQueue: max_in_flight must be at least 1, got {max_in_flight}")
        self.device = torch.device(device)
        self.max_in_flight = max_in_flight
        self.streams = streams if streams is not None else default_streams(self.device)
        self._side: Any = None
        self._in_flight: deque[StreamCopy] = deque()

    @property
    def active(self) -> bool:
        """Whether copies can leave the caller's thread (an accelerator is present)."""
        return self.streams is not None

    def __len__(self) -> int:
        """Copies issued whose completion has not been observed yet."""
        return len(self._in_flight)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """``dst.copy_(src)``, on the side stream when it moves between host and device."""
        if self.streams is None or not self.streams.crosses(dst.device, src.device):
            dst.copy_(src)
            return DONE
        self._retire()
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().synchronize()
        if self._side is None:
            self._side = self.streams.new_stream()
        ready = self.streams.new_event()
        ready.record(self.streams.current())
        self._side.wait_event(ready)
        with self.streams.using(self._side):
            dst.copy_(src, non_blocking=True)
        done = self.streams.new_event()
        done.record(self._side)
        issued = StreamCopy(dst, src, done, self)
        self._in_flight.append(issued)
        return issued

    def to(self, src: torch.Tensor, device: torch.device,
           dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Copy]:
        """``src`` converted to ``device`` and ``dtype`` and the copy to wait for: a new (pinned,
        on the host) tensor filled on the side stream, or ``src.to(...)`` where no stream is used."""
        device = torch.device(device)
        if self.streams is None or not self.streams.crosses(device, src.device):
            return src.to(device=device, dtype=dtype), DONE
        pin = device.type == "cpu" and torch.accelerator.is_available()
        dst = torch.empty(src.shape, dtype=dtype or src.dtype, device=device, pin_memory=pin)
        return dst, self.copy(dst, src)

    def synchronize(self) -> None:
        """Wait on the host for every copy in flight (before the host overwrites a source)."""
        while self._in_flight:
            self._in_flight.popleft().synchronize()

    def _retire(self) -> None:
        """Forget copies already done (their tensors may be freed)."""
        while self._in_flight and (self._in_flight[0].event is None or self._in_flight[0].event.query()):
            self._in_flight.popleft().retire()
