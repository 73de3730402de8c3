"""The data path (slices with their position ids), the ``ulysses`` record's options, and what
initialize refuses with ``sequence_parallel_size``."""
from __future__ import annotations

import pytest
import torch

import sequence_ranks as sr
import zkit
from zkit.core.attention import build_attention
from zkit.core.config import load_config
from zkit.core.config.errors import ConfigError
from zkit.testing import run_ranks
from zkit_sequence import shard, with_positions


def test_a_tuple_batch_gains_position_ids_and_each_rank_its_slice():
    ids = torch.arange(12).view(2, 6)
    batch = with_positions((ids, ids + 100, "meta"))
    assert batch[3].tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    mine = shard(batch, 1, 3)
    assert mine[0].tolist() == [[2, 3], [8, 9]] and mine[1].tolist() == [[102, 103], [108, 109]]
    assert mine[2] == "meta" and mine[3].tolist() == [[2, 3], [2, 3]]


def test_a_dict_batch_keeps_its_position_ids():
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    assert shard(with_positions(batch), 1, 2)["position_ids"].tolist() == [[0, 1]]


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="sequence of 5 tokens does not split over sequence_parallel_size 2"):
        shard(with_positions((torch.zeros(1, 5),)), 0, 2)


def test_the_key_must_divide_the_world():
    with pytest.raises(ConfigError, match="'sequence_parallel_size' 3 does not divide the 4 data-parallel ranks"):
        load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 3}, world_size=4)
    with pytest.raises(ConfigError, match="'sequence_parallel_size' must be an int >= 1, got 0"):
        load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 0}, world_size=4)


def test_the_batch_counts_a_sequence_group_as_one_replica():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                       "sequence_parallel_size": 2}, world_size=8)
    assert (cfg.train_batch_size, cfg.world_size) == (2 * 3 * 4, 4)
    with pytest.raises(ConfigError, match=r"train_batch_size 48 != .* \* world size 4"):
        load_config({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "sequence_parallel_size": 2}, world_size=8)


@pytest.mark.parametrize("options,message", [
    ({"inner": "ulysses", "num_heads": 4}, "inner must name another attention record"),
    ({"num_heads": 4, "num_kv_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ({"inner": "block_sparse", "num_heads": 4, "mode": "fixed", "block": 8, "different_layout_per_head": True},
     "different_layout_per_head"),
])
def test_bad_options_of_the_record(options, message):
    if options.get("inner") == "block_sparse":
        pytest.importorskip("zkit_sparse")
    with pytest.raises(ValueError, match=message):
        build_attention("ulysses", **options)


def test_unbound_it_is_the_inner_attention_with_repeated_key_value_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 6), torch.randn(2, 2, 8, 6), torch.randn(2, 2, 8, 6)
    got = build_attention("ulysses", num_heads=4, num_kv_heads=2, head_dim=6)(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    torch.testing.assert_close(got, want)


def _initialize(model_kind: str) -> str:
    config = sr.engine_config(2, 0, 1, 1)
    if model_kind == "dense":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    else:  # a model that brings its own data-parallel group, as zkit-pipeline's do
        model = torch.nn.Linear(4, 4)
        model.data_parallel_group = torch.distributed.new_group([0, 1])
    try:
        zkit.initialize(model=model, config=config)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_a_model_without_sequence_parallel_attention_is_refused():
    for r in run_ranks(_initialize, 2, args=("dense",), timeout=120):
        assert "sequence_parallel_size 2: the model has no sequence-parallel attention" in r, r


def test_pipeline_or_tensor_parallel_models_are_refused():
    for r in run_ranks(_initialize, 2, args=("grid",), timeout=120):
        assert "sequence_parallel_size 2 with a model that brings its own data-parallel group" in r, r
        assert "pipeline or tensor parallelism" in r


def test_without_the_plugin_the_key_is_refused():
    results = run_ranks(_initialize, 2, args=("dense",), timeout=120, env={"ZKIT_BLOCK_PLUGINS": "zkit-sequence"},
                        start="spawn")
    for r in results:
        assert "config key 'sequence_parallel_size' is 2, but no plugin provides sequence parallelism" in r, r
        assert "pip install zkit-sequence" in r
