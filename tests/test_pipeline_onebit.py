"""1-bit compression composes with ZeRO-2 and with the pipeline: every micro-step, the engine's or a
pipeline stage's, runs one protocol (zkit.core.microstep), and the compressing communicator keeps its
error buffers per gradient unit, not per scratch bucket."""
import pytest
import torch

from zkit.testing import run_ranks

import pipeline_onebit_ranks as por


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(por.pipeline_against_plain, 4, timeout=300)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(por.onebit_communicator_stage2_against_stage1, 2, timeout=300)


def test_pipeline_zero2_onebit_adam_trains_the_model_of_the_same_run_without_pipeline(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert r["worst"] < 1e-5, f"rank {rank}: parameters differ from the run without pipeline by {r['worst']:.2e}"
        assert r["frozen"] and r["moved"] > 1e-3
        assert r["compressed"] == (por.STEPS - por.FREEZE) * por.MICRO * 2  # two 64x64 weights per stage


def test_pipeline_train_batch_returns_the_detached_data_parallel_mean(four_ranks):
    for r in four_ranks:
        assert not r["requires_grad"]
    # every rank returns the mean over both replicas of the replica's own loss
    by_replica = {r["replica"]: r["replica_losses"] for r in four_ranks}
    assert sorted(by_replica) == [0, 1]
    for step in range(por.STEPS):
        mean = (by_replica[0][step] + by_replica[1][step]) / 2
        for r in four_ranks:
            assert r["losses"][step] == pytest.approx(mean, rel=1e-5)


def test_onebit_communicator_at_zero2_keys_error_buffers_by_unit_from_the_first_backward(two_ranks):
    for r in two_ranks:
        one, two = r[1], r[2]
        assert two["compressed"] == one["compressed"] > 0
        # the four 64x64 weights are compressed, each with its own error buffers
        assert two["keys"] == one["keys"] and len(two["keys"]) == 4
        assert torch.equal(two["params"], one["params"])
