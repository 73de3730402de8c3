"""NVMeParamStore on its own: any sequence of read-aheads, gathers and write-backs returns each
shard's latest values, never holds more than ``buffer_count`` shards, and keeps ``max_in_cpu``
elements in memory."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zkit.core.allocator import Allocator
from zkit_offload.param_store import NVMeParamStore
from zkit_offload.swap import NVMeSwapper


class _CPU(Allocator):
    def place(self, purpose):
        return torch.device("cpu")


class FakeUnit:
    """What the store sees of a stage-3 ShardedUnit; ``wait`` finishes a gather in flight."""

    def __init__(self, index: int, values: torch.Tensor) -> None:
        self.unit = types.SimpleNamespace(index=index, shard=values.numel())
        self.module_name = f"m{index}"
        self.shard = values.clone()
        self.store = None
        self.gathering = False

    def stored_in(self, store) -> None:
        self.shard, self.store = None, store

    def shard_to_memory(self, allocator=None) -> None:
        self.shard, self.store = self.store.take(self, allocator), None

    def wait(self) -> None:
        if self.gathering:
            self.gathering = False
            self.store.release(self)


def _store(tmp_path, sizes, dtype=torch.float32, buffer_count=2, max_in_cpu=0, buffer_size=1000):
    swapper = NVMeSwapper(tmp_path, io_threads=2)
    alloc = _CPU(torch.device("cpu"))
    units = [FakeUnit(i, torch.arange(n, dtype=torch.float32).to(dtype) + 100 * i) for i, n in enumerate(sizes)]
    for u in units:
        alloc.track("param", u.shard.numel() * u.shard.element_size())
    store = NVMeParamStore(swapper, alloc, dtype, buffer_count=buffer_count, buffer_size=buffer_size,
                           max_in_cpu=max_in_cpu)
    store.adopt(units)
    return store, units, swapper, alloc


OPS = st.lists(st.tuples(st.sampled_from(["prefetch", "gather", "finish", "put"]), st.integers(0, 4)), max_size=25)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, buffer_count=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_sequence_reads_the_latest_values(tmp_path, ops, buffer_count, dtype):
    sizes = [5, 1, 17, 8, 3]
    store, units, swapper, _ = _store(tmp_path, sizes, dtype, buffer_count)
    expected = [torch.arange(n, dtype=torch.float32).to(dtype) + 100 * i for i, n in enumerate(sizes)]
    try:
        for k, (op, i) in enumerate(ops):
            u = units[i]
            if op == "prefetch":
                store.prefetch(u)
            elif op == "gather" and not u.gathering:
                got = store.get(u)
                assert torch.equal(got, expected[i])
                u.gathering = True
            elif op == "finish":
                u.wait()
            elif op == "put" and not u.gathering:
                expected[i] = torch.full((sizes[i],), float(k), dtype=torch.float32).to(dtype)
                store.put(u, expected[i].float())
            assert sum(b.unit is not None for b in store.buffers) <= buffer_count
            assert sum(u.gathering for u in units) <= buffer_count
        for u in units:
            u.wait()
        for i, u in enumerate(units):
            assert torch.equal(store.get(u), expected[i])
            store.release(u)
        store.flush()
    finally:
        swapper.close()


def test_adopt_frees_memory_and_keeps_max_in_cpu(tmp_path):
    store, units, swapper, alloc = _store(tmp_path, [4, 6, 10], max_in_cpu=10, buffer_count=3)
    try:
        # 4 + 6 elements fit max_in_cpu: those two shards stay; the third goes to its swap file
        assert [u.store is store for u in units] == [False, False, True]
        assert units[2].shard is None and store.nvme_bytes == 40
        assert alloc.stats()["param"]["live"] == (4 + 6) * 4 + 3 * 10 * 4  # kept shards + 3 buffers
        assert len(swapper.keys()) == 1
    finally:
        swapper.close()


def test_every_buffer_busy_finishes_the_oldest_gather(tmp_path):
    store, units, swapper, _ = _store(tmp_path, [3, 3, 3], buffer_count=2)
    try:
        for u in units[:2]:
            store.get(u)
            u.gathering = True
        assert torch.equal(store.get(units[2]), torch.arange(3.0) + 200)
        assert not units[0].gathering and units[1].gathering
    finally:
        swapper.close()


def test_put_while_gathering_is_an_error(tmp_path):
    store, units, swapper, _ = _store(tmp_path, [3])
    try:
        store.get(units[0])
        with pytest.raises(RuntimeError) as info:
            store.put(units[0], torch.zeros(3))
        assert str(info.value) == "the shard of stage-3 module 'm0' was changed while a gather was reading it"
    finally:
        swapper.close()


def test_ready_says_whether_a_get_would_wait_for_the_disk(tmp_path):
    store, units, swapper, _ = _store(tmp_path, [3, 3], buffer_count=2)
    try:
        assert not store.ready(units[0])  # in its swap file only
        store.prefetch(units[0])
        store.flush()  # the read has finished
        assert store.ready(units[0]) and not store.ready(units[1])
        assert torch.equal(store.get(units[0]), torch.arange(3.0))
        assert store.ready(units[0])
    finally:
        swapper.close()


def test_a_put_keeps_the_read_aheads(tmp_path):
    """A shard written while the buffers hold read-aheads (step_in_backward's puts during backward)
    goes through put()'s own staging: the read-aheads stay, and nothing is read twice."""
    store, units, swapper, _ = _store(tmp_path, [5, 1, 17], buffer_count=2)
    try:
        before = swapper.bytes_read
        store.prefetch(units[1])
        store.prefetch(units[2])
        store.put(units[0], torch.full((5,), 7.0))
        assert [b.unit for b in store.buffers] == [units[1], units[2]]
        for u in units[1:]:
            assert torch.equal(store.get(u), torch.arange(float(u.unit.shard)) + 100 * u.unit.index)
            store.release(u)
        assert swapper.bytes_read - before == (1 + 17) * 4
        assert torch.equal(store.get(units[0]), torch.full((5,), 7.0))  # read after its write landed
    finally:
        swapper.close()
