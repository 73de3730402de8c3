"""What zkit-offload needs of the kernel reaches it through hooks and records, not through members
shaped after it: step-in-backward starts from the plugin's ``zkit_before_backward``, the NVMe
store's alignment is a field of its allocator record, a stage-3 shard moves into a store through
``ShardedUnit`` methods."""
from __future__ import annotations

import types

import attrs
import pytest
import torch

from zkit.estimator import model_state_bytes
from zkit.estimator.command import estimate_memory, store_align_elems
from zkit.core.plugin_manager import get_plugin_manager
from zkit.core.records import AllocatorRecord
from zkit.core.stores import MasterStore
from zkit_offload import plugin
from zkit_offload.io_memory import ALIGN_ELEMS


def test_the_master_store_protocol_says_nothing_of_stepping_in_backward():
    members = {"begin_last_backward", "stepped_in_backward", "cancel_backward_step"}
    assert not members & set(dir(MasterStore))
    assert "skip_step" in dir(MasterStore)


class _Store:
    def __init__(self, step_in_backward: bool) -> None:
        self.step_in_backward = step_in_backward
        self.began: list[tuple] = []

    def begin_last_backward(self, optimizer, owned, publish) -> None:
        self.began.append((optimizer, owned, publish))


def _micro_step(store):
    partitioner = types.SimpleNamespace(optimizer="opt", owned=["piece"], publish_from_buffer="publish")
    return types.SimpleNamespace(allocator=types.SimpleNamespace(master_store_made=store), partitioner=partitioner)


def test_the_step_in_backward_begins_through_the_hook_at_the_boundary_only():
    store = _Store(step_in_backward=True)
    pm = get_plugin_manager()
    pm.hook.zkit_before_backward(micro_step=_micro_step(store), loss=None, boundary=False)
    assert store.began == []
    pm.hook.zkit_before_backward(micro_step=_micro_step(store), loss=None, boundary=True)
    assert store.began == [("opt", ["piece"], "publish")]


@pytest.mark.parametrize("store", [_Store(step_in_backward=False), None])
def test_without_step_in_backward_the_hook_does_nothing(store):
    plugin.zkit_before_backward(micro_step=_micro_step(store), boundary=True)
    assert store is None or store.began == []
    # an allocator that is not zkit-offload's has no such store
    plugin.zkit_before_backward(micro_step=types.SimpleNamespace(allocator=object(), partitioner=None), boundary=True)


def test_the_nvme_alignment_comes_from_its_allocator_record():
    records = get_plugin_manager().records("allocator")
    assert records["nvme"].align_elems == ALIGN_ELEMS == 1024
    assert records["host"].align_elems == records["flat"].align_elems == 1
    assert store_align_elems("nvme") == ALIGN_ELEMS and store_align_elems("cpu") == 1
    shapes = [("a", (1000,)), ("b", (10,))]
    # two units (shards of 500 and 5 elements on each of 2 ranks), each starting on a block
    kwargs = dict(stage=2, world_size=2, dtype="fp32", offload="nvme", reduce_bucket_size=1000)
    aligned = model_state_bytes(shapes, align_elems=ALIGN_ELEMS, **kwargs)
    assert aligned.nvme["master"] == 2 * ALIGN_ELEMS * 4
    assert model_state_bytes(shapes, **kwargs).nvme["master"] == (500 + 5) * 4  # packed back to back
    row = estimate_memory(num_params=1010, world_sizes=(2,), stages=(2,), offloads=("nvme",), dtypes=("fp32",),
                          reduce_bucket_size=1000).rows[0]
    assert row.states.nvme["master"] == 2 * ALIGN_ELEMS * 4


def test_an_alignment_below_one_element_is_refused():
    with pytest.raises(ValueError, match="'align_elems' must be >= 1"):
        AllocatorRecord(name="x", factory=lambda device, config: None, align_elems=0)
    assert attrs.evolve(AllocatorRecord(name="x", factory=lambda d, c: None), align_elems=8).align_elems == 8


def test_a_shard_moves_into_a_store_and_back_through_the_unit():
    from zkit.core.allocator import Allocator
    from zkit.zero.flat import plan_units
    from zkit.zero.sharded_params import ShardedUnit

    class _CPU(Allocator):
        def place(self, purpose):
            return torch.device("cpu")

    class _Keep:  # takes the shard it was given back out
        def take(self, su, allocator=None, into=None):
            return held.clone()

    alloc = _CPU(torch.device("cpu"))
    params = [torch.nn.Parameter(torch.arange(6.0))]
    (unit,) = plan_units([("w", (6,))], 1 << 30, 1)
    comm = types.SimpleNamespace(rank=0, world_size=1)
    su = ShardedUnit.from_params(unit, params, comm, alloc, 0, "m")
    held = su.shard.clone()
    store = _Keep()
    su.stored_in(store)
    assert su.shard is None and su.store is store
    su.shard_to_memory()
    assert not su.store.shards_leave_memory and torch.equal(su.shard, torch.arange(6.0))
