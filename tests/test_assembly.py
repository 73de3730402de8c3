"""The assembly hands every part of a job its communicator: one registered by a third party and
chosen by the stack carries ZeRO's collectives, zero.Init's and initialize's broadcasts, activation partitioning
and zkit-pipeline's transfers, tied sums, grid norm and tensor-parallel layers."""
from __future__ import annotations

import pytest
import torch

import assembly_ranks as ar
import zkit
from zkit.core.assembly import Assembly
from zkit.core.records import OptimizerRecord
from zkit.testing import run_ranks


@pytest.fixture(scope="module")
def calls():
    return run_ranks(ar.everywhere, 2, timeout=300)


def test_zero_and_init_use_the_registered_communicator(calls):
    for rank in calls:
        assert rank["zero"]["init"]["world"]["broadcast"] > 0
        engine = rank["zero"]["engine"]["world"]
        assert engine["all_gather"] > 0 and engine["reduce_scatter"] > 0


def test_initialize_broadcasts_rank_0s_weights_through_the_registered_communicator(calls):
    for rank in calls:
        assert rank["setup"]["broadcasts"] > 0 and rank["setup"]["same"]
        assert "broadcast" not in rank["setup"]["stats"]  # set-up traffic: comm_stats counts training's


def test_activation_partitioning_uses_the_engine_communicator(calls):
    for rank in calls:
        assert rank["activations"]["activations"]["all_gather"] > 0


def test_pipeline_grid_uses_the_registered_communicator(calls):
    for rank in calls:
        p = rank["pipeline"]
        assert p["world"]["send"] > 0 and p["world"]["recv"] > 0  # activations and gradients
        assert p["tied"]["all_reduce"] > 0  # the tied weight's gradient sum
        assert p["model"]["all_reduce"] > 0  # the grid-wide gradient norm
        assert p["pipe"]["broadcast"] > 0  # the last stage's loss
        assert "other" not in p


def test_tensor_parallel_layers_use_the_engine_communicator(calls):
    for rank in calls:
        assert rank["tensor"]["tensor"]["all_gather"] > 0


def _one_rank(fn):
    return run_ranks(fn, 1, timeout=120)[0]


def needs_communicator_factory() -> list[bool]:
    seen = []

    def factory(groups, comm=None, **params):
        seen.append(comm is not None and comm.world_size == 1)
        return torch.optim.SGD(groups, lr=0.1)

    record = OptimizerRecord(name="wants_comm", factory=factory, needs_communicator=True)
    plain = OptimizerRecord(name="plain", factory=lambda groups, **params: (seen.append("comm" in params), torch.optim.SGD(groups, lr=0.1))[1])
    cfg = {"train_batch_size": 1}
    engine, *_ = zkit.initialize(model=torch.nn.Linear(2, 2), config=cfg, stack=zkit.Stack(optimizer=record))
    assert engine.optimizer is not None
    zkit.initialize(model=torch.nn.Linear(2, 2), config=cfg, stack=zkit.Stack(optimizer=plain))
    return seen


def test_an_optimizer_record_that_needs_a_communicator_gets_the_engines():
    assert _one_rank(needs_communicator_factory) == [True, False]


def assembly_caches_per_group() -> tuple[bool, bool]:
    assembly = Assembly.build()
    group = torch.distributed.new_group([0])
    return (assembly.communicator(None) is assembly.communicator(None),
            assembly.communicator(group) is not assembly.communicator(None))


def test_the_assembly_gives_one_communicator_per_group():
    assert _one_rank(assembly_caches_per_group) == (True, True)
