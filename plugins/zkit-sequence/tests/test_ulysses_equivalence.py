"""Ulysses sequence parallelism against one process on the whole sequence (plain PyTorch): the loss
and every gradient of a micro-step, and the parameters after training, of a small Llama-style model
with grouped-query attention, on 2 and 4 sequence-parallel ranks and 2 x 2 with data parallelism,
at every ZeRO stage."""
from __future__ import annotations

import pytest
import torch

import sequence_ranks as sr
from zkit.testing import run_ranks

#: (world, sequence_parallel_size): 2 and 4 ranks on one sequence, and 2 sequence x 2 data ranks
LAYOUTS = [(2, 2), (4, 4), (4, 2)]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    """The largest difference relative to the reference's largest element."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def _check_grads(results, rtol=1e-5):
    for rank, r in enumerate(results):
        assert abs(r["loss"] - r["ref_loss"]) <= rtol * abs(r["ref_loss"]), (rank, r["loss"], r["ref_loss"])
        assert r["grads"].keys() == r["ref_grads"].keys()
        for name, want in r["ref_grads"].items():
            assert _close(r["grads"][name], want, rtol) <= rtol, (rank, name, _close(r["grads"][name], want, rtol))


@pytest.mark.parametrize("world,sp", LAYOUTS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_micro_step_gives_the_whole_sequence_loss_and_gradients(world, sp, stage):
    # 4 query heads, 2 key-value heads: at 4 ranks each key-value head is repeated to one per rank
    results = run_ranks(sr.grads_of_one_step, world, args=(sp, stage, {}), timeout=300)
    _check_grads(results)
    for rank, r in enumerate(results):
        width = sr.SEQ // sp
        assert r["shape"] == (2, width)
        assert r["positions"] == list(range((rank % sp) * width, (rank % sp + 1) * width))


def test_all_to_all_bytes_are_counted_on_the_sequence_communicator():
    world = sp = 2
    results = run_ranks(sr.grads_of_one_step, world, args=(sp, 0, {}), timeout=300)
    cfg = sr.model_config()
    micro, width = 2, sr.SEQ // sp
    q = micro * width * cfg.n_head * cfg.head_dim * 4  # bytes of this rank's queries (fp32)
    kv = micro * width * cfg.n_kv_head * cfg.head_dim * 4
    # forward: q, k, v, out; backward: the same four again (the adjoint of each is an all-to-all)
    per_layer = 2 * (q + kv + kv + q)
    for r in results:
        stats = r["seq_stats"]["all_to_all"]
        assert stats["calls"] == 8 * cfg.n_layer
        assert stats["bytes"] == cfg.n_layer * per_layer * (sp - 1) // sp


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2)])
def test_block_sparse_inner_attention(world, sp):
    pytest.importorskip("zkit_sparse")
    options = {"attention": "block_sparse", "attention_kwargs": {"mode": "fixed", "block": 8, "num_local_blocks": 2}}
    _check_grads(run_ranks(sr.grads_of_one_step, world, args=(sp, 2, options), timeout=300))


def test_tiled_mlp_and_loss_under_sequence_parallelism():
    _check_grads(run_ranks(sr.grads_of_one_step, 2, args=(2, 3, {"mlp_tiles": 4, "loss_tiles": 3}), timeout=300))


@pytest.mark.parametrize("stage", [0, 3])
def test_multiquery_attention_repeats_the_key_value_head(stage):
    _check_grads(run_ranks(sr.grads_of_one_step, 4, args=(4, stage, {"n_kv_head": 1}), timeout=300))


@pytest.mark.parametrize("case", [
    dict(world=2, sp=2, stage=2, accum=2),
    dict(world=4, sp=2, stage=3, accum=1),
    dict(world=2, sp=2, stage=1, accum=1, model={"checkpoint_blocks": True},
         extra={"activation_checkpointing": {"cpu_checkpointing": True}}),
    dict(world=2, sp=2, stage=3, accum=2, model={"checkpoint_blocks": True, "mlp_tiles": 2, "loss_tiles": 2}),
])
def test_training_equals_whole_sequence_training(case):
    results = run_ranks(sr.train_steps, case["world"], args=(case["sp"], case["stage"], case.get("model", {})),
                        kwargs={"accum": case["accum"], "extra": case.get("extra")}, timeout=400)
    for r in results:
        for name, want in r["ref_params"].items():
            assert _close(r["params"][name], want, 1e-5) <= 1e-5, name


def test_bf16_training_stays_near_the_fp32_reference():
    results = run_ranks(sr.train_steps, 2, args=(2, 2, {}), kwargs={"extra": {"bf16": {"enabled": True}}},
                        timeout=400)
    for r in results:
        for name, want in r["ref_params"].items():
            assert _close(r["params"][name], want, 5e-2) <= 5e-2, name


@pytest.mark.parametrize("options,words", [
    ({"n_head": 6, "n_kv_head": 6, "d_model": 48}, ("sequence_parallel_size 4", "6 attention heads")),
    ({"n_head": 4, "n_kv_head": 4, "d_model": 32}, None),
])
def test_heads_not_divisible_by_the_size_are_refused_at_initialize(options, words):
    results = run_ranks(sr.refused, 4, args=(4, options), timeout=120)
    for r in results:
        if words is None:
            assert r == "accepted"
        else:
            assert all(w in r for w in words), r


def test_key_value_heads_that_do_not_split_are_refused():
    results = run_ranks(sr.refused, 4, args=(4, {"n_head": 12, "n_kv_head": 3, "d_model": 48}), timeout=120)
    assert all("sequence_parallel_size 4" in r and "3 key-value heads" in r for r in results), results
