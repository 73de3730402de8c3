"""Stage 3's default parameter-shard store: the shards in memory behind the same interface as a
plugin's store (``zkit/zero/memory_param_store.py``), so stage 3 has one code path."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import zkit
from zkit.core.stores import ParamShardStore
from zkit.zero.memory_param_store import IN_MEMORY, InMemoryParamShardStore

import engine_ranks as er

ZERO = pathlib.Path(zkit.__file__).parent / "zero"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_a_plugin_store_every_shard_is_in_the_in_memory_store(dtype):
    engine = zkit.initialize(model=er.make_model(), config=er.config(3, dtype, 1, 1))[0]
    try:
        part = engine.partitioner
        assert part.param_store is IN_MEMORY and isinstance(IN_MEMORY, (InMemoryParamShardStore, ParamShardStore))
        assert not IN_MEMORY.shards_leave_memory and not IN_MEMORY.may_wait_for_buffer and IN_MEMORY.lookahead == 0
        for su in part.sharded:
            assert su.store is IN_MEMORY and IN_MEMORY.ready(su)
            # the shard itself, no copy: stage 3 steps it in place and copies out into it
            assert su.local_shard() is su.shard
            assert part.publish_target(su.unit.index) is su.shard
        er.train_engine(engine, 2, 1, 1)
        # a put is the shard's new values
        su = part.sharded[0]
        IN_MEMORY.put(su, torch.full_like(su.shard, 0.5))
        su.copy.wait()
        assert torch.all(su.shard == 0.5)
    finally:
        engine.close()


def test_the_in_memory_store_gives_its_shard_back_and_takes_others_into_memory():
    class Held:  # a unit in some other store
        def __init__(self) -> None:
            self.store, self.moved = object(), False

        def shard_to_memory(self) -> None:
            self.moved = True

    other, mine = Held(), Held()
    mine.store = IN_MEMORY
    IN_MEMORY.adopt([other, mine])
    assert other.moved and not mine.moved
    mine.shard = torch.arange(4.0)
    assert IN_MEMORY.take(mine) is mine.shard
    into = torch.zeros(4)
    assert IN_MEMORY.take(mine, into=into) is into and torch.equal(into, mine.shard)


def test_stage3_never_asks_whether_there_is_a_shard_store():
    for path in ZERO.glob("*.py"):
        text = path.read_text()
        found = re.findall(r"(?:\.store|param_store) is (?:not )?None", text)
        assert not found, (path.name, found)


def test_a_plugin_store_missing_a_member_is_refused_at_set_up_naming_it():
    from zkit.zero.memory_param_store import param_shard_store

    class OldStore:  # a store written before the two attributes existed
        dtype, lookahead = torch.float32, 1

        def adopt(self, units): ...
        def take(self, su, allocator=None, into=None): ...
        def prefetch(self, su): ...
        def ready(self, su): ...
        def get(self, su): ...
        def release(self, su): ...
        def put(self, su, values): ...

    class Allocator:
        def param_shard_store(self, dtype):
            return OldStore()

    with pytest.raises(TypeError, match=r"returned OldStore, which is not a zkit.core.stores.ParamShardStore: "
                                        r"it lacks may_wait_for_buffer, shards_leave_memory"):
        param_shard_store(Allocator(), torch.float32)
    # the members are listed once, when the module loads, and are every member of the protocol
    from zkit.zero.memory_param_store import PARAM_SHARD_STORE_MEMBERS
    assert set(PARAM_SHARD_STORE_MEMBERS) == {
        "dtype", "lookahead", "shards_leave_memory", "may_wait_for_buffer",
        "adopt", "take", "prefetch", "ready", "get", "release", "put"}
