"""Where stage 2-3's reduced gradient chunks land (``zkit/zero/grad_sinks.py``): the stage has one
reduction path, and the sink says whether a chunk is reduced into its shard or into the bucket."""
from __future__ import annotations

import pathlib

import torch

import zkit
from zkit.zero.flat import plan_units
from zkit.zero.grad_sinks import GradShards, StoreGrads

ZERO = pathlib.Path(zkit.__file__).parent / "zero"


class _Allocator:
    def __init__(self) -> None:
        self.made, self.released = [], []

    def empty(self, n, dtype, purpose):
        self.made.append(("empty", purpose))
        return torch.full((n,), float("nan"), dtype=dtype)

    def zeros(self, n, dtype, purpose):
        self.made.append(("zeros", purpose))
        return torch.zeros(n, dtype=dtype)

    def release(self, tensor, purpose):
        self.released.append(purpose)


def _units():
    return plan_units([("a", (3,)), ("b", (4,))], 1 << 20, 1)


def test_the_first_micro_step_reduces_into_the_shard_later_ones_into_the_bucket_then_add():
    alloc = _Allocator()
    sink = GradShards(_units(), alloc, torch.float32, torch.float32, False, torch.device("cpu"))
    chunk = torch.ones(7)
    target = sink.reduce_target(0, chunk)
    assert target is sink.shards[0] and alloc.made == [("empty", "grad")]  # written whole: not zeroed
    target.copy_(chunk)
    sink.add_grad(0, target)
    sink.end_backward()
    assert sink.reduce_target(0, chunk) is chunk
    sink.add_grad(0, chunk)
    assert torch.equal(sink.get()[0], torch.full((7,), 2.0))
    sink.release()
    assert sink.shards == [] and alloc.released == ["grad"] and sink.reduce_target(0, chunk) is sink.shards[0]


def test_a_wider_accumulation_dtype_or_the_master_beside_take_the_bucket_chunk_from_the_start():
    for accum, beside, made in [(torch.float32, False, ("zeros", "grad")), (torch.bfloat16, True, ("empty", "master_grad"))]:
        alloc = _Allocator()
        sink = GradShards(_units(), alloc, accum, torch.bfloat16, beside, torch.device("cpu"))
        chunk = torch.full((7,), 1.5, dtype=torch.bfloat16)
        assert sink.reduce_target(0, chunk) is chunk and alloc.made == [made]
        sink.add_grad(0, chunk)
        assert sink.shards[0].dtype == torch.float32 and torch.equal(sink.shards[0], torch.full((7,), 1.5))


def test_a_store_that_takes_the_gradients_gets_every_chunk():
    class Store:
        takes_grads = True

        def __init__(self):
            self.got = []

        def add_grad(self, unit, grad):
            self.got.append((unit, grad))

    store = Store()
    sink = StoreGrads(store)
    chunk = torch.ones(3)
    assert sink.reduce_target(1, chunk) is chunk and sink.shards == []
    sink.add_grad(1, chunk)
    assert store.got == [(1, chunk)]


def test_stage2_has_one_reduction_path_whoever_holds_the_gradients():
    text = (ZERO / "stage2.py").read_text()
    assert text.count("takes_grads") == 1  # the choice of sink, once
    assert "master_store.add_grad" not in text and "if self.grads_beside_master" not in text
