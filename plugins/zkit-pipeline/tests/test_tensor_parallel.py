"""Tensor-parallel layers, cross-entropy and GPT equal their dense counterparts (2 gloo ranks)."""
from __future__ import annotations

import pytest
import torch

import tp_ranks
from zkit.testing import run_ranks
from zkit_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zkit_pipeline.tensor_parallel import get_rng_tracker, vocab_parallel_cross_entropy
from zkit_pipeline.tensor_parallel.rng_tracker import RNGStatesTracker
from zkit_pipeline.tp_gpt import TensorParallelGPTConfig, TensorParallelGPT


def _all_close(results):
    for rank, checks in enumerate(results):
        for name, (ok, err) in checks.items():
            assert ok, f"rank {rank}: {name} differs from dense by {err}"


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(tp_ranks.all_checks, 2, args=(3,), timeout=180)


def test_layers_equal_dense_forward_and_grads(two_ranks):
    _all_close([r["layers"] for r in two_ranks])


def test_vocab_parallel_cross_entropy_equals_dense(two_ranks):
    _all_close([r["cross_entropy"] for r in two_ranks])


def test_dropout_rng_replicated_vs_split(two_ranks):
    for r in two_ranks:
        assert r["dropout"] == {"replicated_same": True, "split_differs": True, "fork_advances": True}


def test_tensor_parallel_gpt_trains_like_dense(two_ranks):
    for r in (x["gpt"] for x in two_ranks):
        for dense, parallel in r["losses"]:
            assert parallel == pytest.approx(dense, rel=1e-4)


class _OneRank:
    rank, world_size = 0, 2


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ColumnParallelLinear(4, 5, _OneRank()), r"ColumnParallelLinear out_features \(5\) must be divisible by the tensor-parallel size \(2\)"),
        (lambda: RowParallelLinear(3, 4, _OneRank()), r"RowParallelLinear in_features \(3\) must be divisible"),
        (lambda: VocabParallelEmbedding(7, 4, _OneRank()), r"num_embeddings \(7\) must be divisible"),
        (lambda: TensorParallelGPT(TensorParallelGPTConfig(d_model=30, n_heads=4)), r"d_model \(30\) must be divisible by n_heads \(4\)"),
    ],
)
def test_bad_shapes_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_cross_entropy_checks_target_shape():
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal the logits' leading shape \(2,\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))


def test_rng_tracker_errors():
    tracker = RNGStatesTracker()
    with pytest.raises(ValueError, match="call model_parallel_seed"):
        with tracker.fork("nope"):
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG state 'a' already exists"):
        tracker.add("a", 2)
    assert get_rng_tracker() is get_rng_tracker()


def test_partition_activations_from_the_config_alone():
    # DeepSpeed needs configure(mpu, ...); here the engine knows the model's tensor-parallel group
    for r in run_ranks(tp_ranks.partition_activations_from_config, 2, timeout=120):
        assert r == {"splits": True, "group_size": 2}
