"""A :class:`zkit.zero.copy_queue.Streams` for CPU tests that makes copies really asynchronous.

Every copy a :class:`~zkit.zero.copy_queue.CopyQueue` issues on the side stream is *deferred*: it runs only
when an event recorded after it is waited for (``event.synchronize()``, or the compute stream's
``wait_event``). Code that reads a copy's destination without waiting for its copy reads stale
values, and code that overwrites a copy's source before the copy ran sends the new values, so an
engine run through these streams differs from a plain run exactly where ordering is missing.
Every call is logged in :attr:`FakeStreams.log` for tests that check the order itself.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from zkit.zero import copy_queue


class FakeEvent:
    def __init__(self, streams: "FakeStreams", name: str) -> None:
        self.streams, self.name = streams, name
        self.upto: int | None = None  # side-stream copies issued before the record

    def record(self, stream: "FakeStream") -> None:
        self.streams.log.append(("record", self.name, stream.name))
        self.upto = self.streams.issued if stream is self.streams.side else None

    def query(self) -> bool:
        return self.upto is None or self.streams.ran >= self.upto

    def synchronize(self) -> None:
        self.streams.log.append(("synchronize", self.name))
        self.streams.run_until(self.upto)


class FakeStream:
    def __init__(self, streams: "FakeStreams", name: str) -> None:
        self.streams, self.name = streams, name

    def wait_event(self, event: FakeEvent) -> None:
        self.streams.log.append(("wait", self.name, event.name))
        if self is self.streams.compute:  # compute runs eagerly: what it waits for runs now
            self.streams.run_until(event.upto)


class _Defer(TorchFunctionMode):
    """While the side stream is current: ``copy_`` is queued on it instead of run."""

    def __init__(self, streams: "FakeStreams") -> None:
        super().__init__()
        self.streams = streams

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            self.streams.pending.append((args[0], args[1]))
            self.streams.issued += 1
            self.streams.log.append(("copy", "side"))
            return args[0]
        return func(*args, **kwargs)


class FakeStreams:
    """Streams whose side-stream copies run late (module docstring). ``crosses`` is true for every
    pair of devices, so all copies of a CPU run go through the side stream."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = FakeStream(self, "compute")
        self.side: FakeStream | None = None
        self.now = self.compute
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.issued = self.ran = 0
        self._events = 0

    def crosses(self, a: torch.device, b: torch.device) -> bool:
        return True

    def current(self) -> FakeStream:
        return self.now

    def new_stream(self) -> FakeStream:
        if self.side is not None:
            raise AssertionError("FakeStreams serves one side stream")
        self.side = FakeStream(self, "side")
        return self.side

    def new_event(self) -> FakeEvent:
        self._events += 1
        return FakeEvent(self, f"e{self._events}")

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        previous, self.now = self.now, stream
        try:
            with _Defer(self) if stream is self.side else contextlib.nullcontext():
                yield
        finally:
            self.now = previous
            self.log.append(("exit", stream.name))

    def run_until(self, upto: int | None) -> None:
        """Run the side stream's copies issued before ``upto`` (``None``: an event recorded on the
        compute stream, complete at once)."""
        if upto is None:
            return
        while self.ran < upto:
            dst, src = self.pending[self.ran]
            self.pending[self.ran] = (None, None)  # type: ignore[assignment]
            dst.copy_(src)
            self.ran += 1

    @property
    def outstanding(self) -> int:
        """Copies issued on the side stream that have not run."""
        return self.issued - self.ran

    def __repr__(self) -> str:
        return f"FakeStreams(issued={self.issued}, ran={self.ran})"


@contextlib.contextmanager
def installed() -> Iterator[list[FakeStreams]]:
    """Inside the block every :class:`~zkit.zero.copy_queue.CopyQueue` created gets its own
    :class:`FakeStreams`, appended to the list this yields."""
    made: list[FakeStreams] = []
    original = copy_queue.default_streams

    def streams(device: torch.device) -> FakeStreams:
        made.append(FakeStreams())
        return made[-1]

    copy_queue.default_streams = streams
    try:
        yield made
    finally:
        copy_queue.default_streams = original
