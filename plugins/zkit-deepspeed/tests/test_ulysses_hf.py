"""``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`` and
``parallel_state_sp`` on the drop-in (zkit-sequence's all-to-alls): Transformers' attention on each
rank's slice equals it over the whole sequence, a Llama's logits too once registered, and
``deepspeed.initialize(mpu=...)`` answers as DeepSpeed's engine does; what zkit does not provide, and
bad input, are refused with DeepSpeed's words or a message naming the feature."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ulysses_hf_ranks as uhr
from zkit.testing import run_ranks

pytest.importorskip("zkit_sequence")
pytest.importorskip("transformers")


@pytest.mark.parametrize("world,kv_heads", [(2, 4), (2, 2), (4, 2), (4, 1)])
def test_hf_attention_equals_whole_sequence_attention(world, kv_heads):
    # (4, 2) and (4, 1): fewer key-value heads than ranks, each repeated to one per rank
    results = run_ranks(uhr.hf_attention, world, args=(kv_heads,), timeout=300)
    for r in results:
        assert r["out"] < 1e-6 and r["grads"] < 1e-6, r
        assert r["shape"] == (uhr.BATCH, uhr.SEQ // world, uhr.HEADS * uhr.DIM)
        assert r["groups_after"] == uhr.HEADS // kv_heads  # the module is left as it was
        assert r["bytes"] > 0  # counted by zkit's communicator


@pytest.mark.parametrize("world", [2, 4])
def test_registered_llama_logits_equal_the_whole_sequence(world):
    results = run_ranks(uhr.llama_logits, world, timeout=300)
    for rank, r in enumerate(results):
        assert r["logits"] < 1e-5, r
        assert r["module"] == "deepspeed.runtime.sequence_parallel.parallel_state_sp"
        assert r["sp"] == (world, rank) and r["seq_dp"] == world and r["model_parallel"] == world


def test_initialize_with_deepspeeds_sequence_groups():
    results = run_ranks(uhr.initialize_with_mpu, 2, args=(2,), timeout=300)
    for r in results:
        assert "config key 'sequence_parallel_size' is 1, but mpu= holds sequence-parallel groups of 2" in r["refused"]
        # DeepSpeed 0.19.8 answers None for the data-parallel size under its sequence mpu
        assert r["dp_world_size"] is None and r["groups"] == (None, 2, 2), r
        assert r["seq_dp_world_size"] == 2 and r["sequence_parallel_size"] == 2
        assert r["train_batch"] == 2  # micro 1 x accumulation 2 x one replica
        assert r["same_group"] and r["mpu"]


def _attention(world_heads: int = 4, kv_heads: int = 4) -> dict:
    return dict(attn=None, batch_size=1, attn_head_count=world_heads, attn_head_size=8, kv_head_count=kv_heads,
                num_hidden_layers=1, seq_length_is_variable=True)


def test_heads_the_ranks_cannot_split_are_refused_naming_both(monkeypatch):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="Attention head count 6 is not divisible by SP size 4"):
        UlyssesSPAttentionHF(process_group=None, **_attention(6, 2))
    with pytest.raises(ValueError, match="KV attention head count 3 is not divisible by SP size 4 or vice versa"):
        UlyssesSPAttentionHF(process_group=None, **_attention(12, 3))
    with pytest.raises(ValueError, match="give local_seq_length and global_seq_length"):
        UlyssesSPAttentionHF(process_group=None, **{**_attention(), "seq_length_is_variable": False})


def test_inputs_of_another_shape_and_calls_without_position_ids_are_refused(monkeypatch):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    attn = UlyssesSPAttentionHF(process_group=None, **{**_attention(), "batch_size": 2})
    module = torch.nn.Module()
    q = torch.zeros(2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"expects query \(2, 4, 8, 8\) and key/value \(2, 4, 8, 8\).*got query "
                                         r"\(1, 4, 8, 8\)"):
        attn(module, q[:1], q[:1], q[:1], None, position_ids=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="Ulysses SP requires position_ids in every forward"):
        attn(module, q, q, q, None)


def test_register_refuses_what_deepspeed_refuses_and_what_zkit_does_not_provide():
    from deepspeed.refused import FeatureNotProvided
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    def model(attn: str) -> SimpleNamespace:  # what register reads of a loaded model before its checks
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))

    register = UlyssesSPAttentionHF.register_with_transformers
    assert register(model("sdpa"), "sdpa", sequence_parallel_size=1, micro_batch_size=1) is None
    with pytest.raises(ValueError, match="Either `seq_length_is_variable` needs to be `True` or `seq_length`"):
        register(model("sdpa"), "sdpa", 2, 1, seq_length_is_variable=False)
    with pytest.raises(ValueError, match="core_attn_implementation='flash_attention_2' does not match model config "
                                         "attn_implementation='sdpa'"):
        register(model("sdpa"), "flash_attention_2", 2, 1)
    with pytest.raises(ValueError, match="eager attn_implementation isn't currently supported by Ulysses"):
        register(model("eager"), "eager", 2, 1)
    with pytest.raises(FeatureNotProvided, match="flex_attention.*is not provided by zkit: use 'sdpa'"):
        register(model("flex_attention"), "flex_attention", 2, 1)
    with pytest.raises(FeatureNotProvided, match="a hub-hosted attention kernel"):
        register(model("kernels-community/flash-attn2"), "kernels-community/flash-attn2", 2, 1)
    with pytest.raises(ValueError, match="no_such_attention is not a valid attn_implementation"):
        register(model("no_such_attention"), "no_such_attention", 2, 1)


def test_sequence_groups_need_a_world_they_divide():
    results = run_ranks(uhr.initialize_errors, 2, timeout=120)
    for r in results:
        assert r == ["world_size (2) is less than sequence_parallel_size 4",
                     "sequence_parallel_size must be greater than 1, got 1",
                     "sequence parallel group is not initialized"], r


def test_the_tiled_functions_stay_refused_naming_zkit_sequence():
    from deepspeed.refused import FeatureNotProvided
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    with pytest.raises(FeatureNotProvided, match="ALST's tiled autograd functions.*zkit_sequence.TiledMLP"):
        ulysses_sp.TiledMLP
