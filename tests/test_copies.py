"""Copies between an allocator's buffers. The kernel's default (zkit/core/copies.py) copies on the
caller's thread, so an allocator without streams needs nothing; the built-in allocators' copy
queue (zkit/zero/copy_queue.py) makes plain copies on a CPU-only run and, with streams, runs each
copy on the side stream after an event of the compute stream, its consumer waiting on its own
event, with no more than ``max_in_flight`` copies outstanding. The streams are
:class:`zkit.fake_streams.FakeStreams`, whose copies run only when waited for."""
from __future__ import annotations

import pytest
import torch

from zkit.core.allocator import Allocator
from zkit.core.copies import DONE, SynchronousCopies
from zkit.fake_streams import FakeStreams
from zkit.zero.copy_queue import CopyQueue, default_streams
from zkit.zero.device_allocator import DeviceAllocator


class _Device(Allocator):
    """A third-party allocator: no copies of its own."""

    def place(self, purpose):
        return self.device


@pytest.mark.parametrize("copies", [_Device(torch.device("cpu")).copies, CopyQueue("cpu")],
                         ids=["kernel default", "copy queue"])
def test_a_cpu_only_run_copies_in_place_without_streams(copies):
    src, dst = torch.arange(5.0), torch.zeros(5)
    assert copies.copy(dst, src) is DONE and torch.equal(dst, src)
    moved, copy = copies.to(src, torch.device("cpu"), torch.bfloat16)
    assert copy is DONE and moved.dtype == torch.bfloat16 and torch.equal(moved.float(), src)
    same, _ = copies.to(src, torch.device("cpu"))
    assert same is src  # as Tensor.to: nothing to move, nothing copied
    copies.synchronize()
    DONE.wait()
    DONE.synchronize()


def test_an_allocator_without_streams_copies_on_the_callers_thread_and_the_builtin_queues():
    assert isinstance(_Device(torch.device("cpu")).copies, SynchronousCopies)
    queue = DeviceAllocator(torch.device("cpu")).copies
    assert isinstance(queue, CopyQueue) and not queue.active and len(queue) == 0
    assert default_streams(torch.device("cpu")) is None


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only answer")
def test_no_streams_for_an_accelerator_that_is_absent():
    assert default_streams(torch.device("cuda")) is None


def test_a_host_consumer_synchronises_on_its_copy_after_it_ran_on_the_side_stream():
    streams = FakeStreams()
    queue = CopyQueue("cpu", streams=streams)
    src, dst = torch.arange(4.0), torch.zeros(4)
    copy = queue.copy(dst, src)
    assert torch.equal(dst, torch.zeros(4))  # issued, not run: the side stream has not got there
    copy.wait()
    assert torch.equal(dst, src)
    assert streams.log == [
        ("record", "e1", "compute"),  # what compute wrote so far ...
        ("wait", "side", "e1"),  # ... is what the copy reads
        ("enter", "side"), ("copy", "side"), ("exit", "side"),
        ("record", "e2", "side"),
        ("synchronize", "e2"),  # the host reads the destination
    ]


def test_a_device_consumer_makes_the_compute_stream_wait_instead_of_the_host():
    streams = FakeStreams()
    queue = CopyQueue("cpu", streams=streams)
    dst = torch.empty(3, device="meta")  # not host memory: its reader is a stream
    queue.copy(dst, torch.ones(3)).wait()
    assert streams.log[-1] == ("wait", "compute", "e2")
    assert not any(entry[0] == "synchronize" for entry in streams.log)


def test_each_consumer_waits_for_its_own_copy_not_for_later_ones():
    streams = FakeStreams()
    queue = CopyQueue("cpu", max_in_flight=8, streams=streams)
    dsts = [torch.zeros(2) for _ in range(3)]
    copies = [queue.copy(d, torch.full((2,), float(i + 1))) for i, d in enumerate(dsts)]
    copies[1].wait()
    assert [d[0].item() for d in dsts] == [1.0, 2.0, 0.0]  # in order, up to the waited one
    assert streams.outstanding == 1


@pytest.mark.parametrize("bound", [1, 3])
def test_the_queue_never_holds_more_than_its_bound(bound):
    streams = FakeStreams()
    queue = CopyQueue("cpu", max_in_flight=bound, streams=streams)
    dsts = [torch.zeros(1) for _ in range(10)]
    for i, d in enumerate(dsts):
        queue.copy(d, torch.full((1,), float(i)))
        assert len(queue) <= bound and streams.outstanding <= bound
    # over the bound, the host waited for the oldest copies first
    waited = [e[1] for e in streams.log if e[0] == "synchronize"]
    recorded = [e[1] for e in streams.log if e[0] == "record" and e[2] == "side"]
    assert waited == recorded[: len(waited)] and len(waited) == 10 - bound
    queue.synchronize()
    assert len(queue) == 0 and [d.item() for d in dsts] == [float(i) for i in range(10)]


def test_finished_copies_leave_the_queue_without_a_wait():
    streams = FakeStreams()
    queue = CopyQueue("cpu", max_in_flight=2, streams=streams)
    first = queue.copy(torch.zeros(1), torch.ones(1))
    first.wait()
    before = len([e for e in streams.log if e[0] == "synchronize"])
    queue.copy(torch.zeros(1), torch.ones(1))
    queue.copy(torch.zeros(1), torch.ones(1))  # the finished first one made room
    assert len([e for e in streams.log if e[0] == "synchronize"]) == before and len(queue) == 2


def test_to_makes_the_destination_and_converts():
    queue = CopyQueue("cpu", streams=FakeStreams())
    src = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    moved, copy = queue.to(src, torch.device("cpu"), torch.float32)
    copy.wait()
    assert moved.shape == (2, 3) and moved.dtype == torch.float32 and torch.equal(moved, src.float())
    assert moved.data_ptr() != src.data_ptr()


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="max_in_flight must be at least 1, got 0"):
        CopyQueue("cpu", max_in_flight=0)


def test_a_copy_known_done_lets_go_of_its_tensors():
    """A unit keeps its last copy: were the copy to keep its source, a gathered buffer written back
    to a host shard would stay alive with it (the whole model, during a build under Init)."""
    import weakref

    streams = FakeStreams()
    queue = CopyQueue("cpu", max_in_flight=8, streams=streams)
    src = torch.ones(4)
    seen = weakref.ref(src)
    kept = queue.copy(torch.zeros(4), src)  # the caller keeps the copy, as a unit does
    del src
    assert seen() is not None  # not run yet: the side stream still reads it
    kept.synchronize()
    assert seen() is None and kept.src is None and kept.dst is None
    kept.wait()  # a wait after the copy is done is a no-op
    kept.synchronize()
    # retired by the queue when it sees the copy done, without the caller waiting
    src = torch.ones(4)
    seen = weakref.ref(src)
    other = queue.copy(torch.zeros(4), src)
    del src
    other.event.synchronize()  # done, but nobody told the copy
    queue.copy(torch.zeros(1), torch.ones(1))  # the next copy retires the finished ones
    assert seen() is None and other.src is None
