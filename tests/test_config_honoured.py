"""Config keys that change what a user gets do so: seed, dataloader_drop_last, wall_clock_breakdown."""
from __future__ import annotations

import random

import pytest

import numpy as np
import torch

import zkit


def _engine(**extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "steps_per_print": 1, **extra}
    return zkit.initialize(model=torch.nn.Linear(4, 2), config=cfg, training_data=extra.pop("_data", None))[0]


def test_seed_seeds_python_numpy_and_torch():
    _engine(seed=1234)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    _engine(seed=1234)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_dataloader_drop_last_follows_the_config():
    data = torch.utils.data.TensorDataset(torch.randn(5, 4))  # 5 samples, micro-batch 2
    keep = zkit.initialize(model=torch.nn.Linear(4, 2), training_data=data, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    assert [len(b[0]) for b in keep.training_dataloader] == [2, 2, 1]  # DeepSpeed's default: keep it
    drop = zkit.initialize(model=torch.nn.Linear(4, 2), training_data=data, config={
        "train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    assert [len(b[0]) for b in drop.training_dataloader] == [2, 2]


def test_wall_clock_breakdown_adds_phase_times_to_the_step_line(caplog):
    for on in (False, True):
        engine = _engine(wall_clock_breakdown=on)
        caplog.clear()
        with caplog.at_level("INFO", logger="zkit"):
            loss = engine(torch.ones(2, 4)).sum()
            engine.backward(loss)
            engine.step()
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1"))
        for phase in ("forward_ms", "backward_ms", "step_ms"):
            assert (phase in line) is on, line


# -- gradient averaging, accumulation dtype ---------------------------------------------------------
from zkit.core.config.errors import NotImplementedConfigError  # noqa: E402
from zkit.testing import run_ranks  # noqa: E402

from tests import honoured_ranks as hr  # noqa: E402


def test_prescale_gradients_keeps_an_fp16_sum_from_overflowing():
    plain = run_ranks(hr.fp16_sum_overflow, 2, args=(False,), timeout=120)
    prescaled = run_ranks(hr.fp16_sum_overflow, 2, args=(True,), timeout=120)
    assert [r["applied"] for r in plain] == [False, False]
    assert [r["applied"] for r in prescaled] == [True, True]


def test_gradient_predivide_factor_gives_the_average():
    runs = [(stage, factor) for stage in (0, 1, 2) for factor in (1.0, 4.0)]
    results = dict(zip(runs, run_ranks(hr.predivide_runs, 2, args=(runs,), timeout=240)[0]))
    for stage in (0, 1, 2):
        plain, divided = results[stage, 1.0], results[stage, 4.0]
        assert max(abs(a - b) for a, b in zip(plain, divided)) < 1e-6, stage


def test_grad_accum_dtype_fp32_accumulates_bf16_micro_steps_in_fp32():
    torch.manual_seed(0)
    engine = zkit.initialize(model=torch.nn.Linear(4, 1, bias=False), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000})[0]
    micro = []
    for i in range(4):
        x = torch.full((1, 4), 1.0 + i / 3, dtype=torch.bfloat16)
        loss = engine(x).float().sum() * 1000
        engine.backward(loss, scale_wrt_gas=False)
        micro.append((x.float() * 1000).to(torch.bfloat16).float().reshape(-1))
        if i < 3:
            engine.step()
    shard = engine.partitioner.grad_shards[0]
    assert shard.dtype == torch.float32
    assert torch.equal(shard[:4], sum(micro))  # a bf16 accumulator would round after each add


def test_grad_accum_dtype_at_stage_0_or_1_is_refused_at_initialize():
    with pytest.raises(ValueError, match="data_types.grad_accum_dtype 'fp32' differs from the bfloat16 gradients of "
                                         "ZeRO stage 1, which accumulate in the parameters' own .grad"):
        zkit.initialize(model=torch.nn.Linear(4, 1), config={
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "data_types": {"grad_accum_dtype": "fp32"}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


# -- checkpoints ------------------------------------------------------------------------------------
def test_tag_validation_warns_or_fails_when_ranks_disagree(tmp_path):
    warned = run_ranks(hr.tags_differ, 2, args=("WARN", str(tmp_path / "w")), timeout=120)
    assert all(w.startswith("saved") for w in warned)
    assert "ranks save under different checkpoint tags (rank 0: 't0', rank 1: 't1'); saving under rank 0's tag 't0'" in warned[0]
    assert (tmp_path / "w" / "latest").read_text() == "t0" and not (tmp_path / "w" / "t1").exists()
    failed = run_ranks(hr.tags_differ, 2, args=("FAIL", str(tmp_path / "f")), timeout=120)
    for out in failed:
        assert out.startswith("CheckpointError: ranks save under different checkpoint tags (rank 0: 't0', rank 1: 't1'); "
                              "checkpoint.tag_validation is FAIL")
    assert not (tmp_path / "f").exists()


def test_save_16bit_model_writes_the_training_dtype_state_dict(tmp_path):
    engine = zkit.initialize(model=torch.nn.Linear(4, 2), config={
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    assert engine.save_16bit_model(str(tmp_path)) is True
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(saved) == {"weight", "bias"} and saved["weight"].dtype == torch.bfloat16
    assert torch.equal(saved["weight"], engine.module.weight.detach())


def test_save_16bit_model_at_stage_3_gathers_only_when_asked(tmp_path):
    skipped = run_ranks(hr.save_16bit_stage3, 2, args=(str(tmp_path / "no"), False), timeout=120)
    assert [r["saved"] for r in skipped] == [False, False] and not (tmp_path / "no" / "model.bin").exists()
    done = run_ranks(hr.save_16bit_stage3, 2, args=(str(tmp_path / "yes"), True), timeout=120)
    saved = torch.load(tmp_path / "yes" / "model.bin", weights_only=True)
    expected = done[0]["expected"]
    assert set(saved) == set(expected)
    for k in expected:
        assert saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], expected[k]), k


# -- the rest ---------------------------------------------------------------------------------------
def test_fp16_auto_cast_casts_the_inputs():
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(x.dtype)
            return super().forward(x)

    for auto in (False, True):
        engine = zkit.initialize(model=Probe(4, 2), config={
            "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "auto_cast": auto},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
        try:
            engine(torch.ones(1, 4))
        except RuntimeError:  # float32 input into float16 weights without auto_cast
            pass
    assert seen == [torch.float32, torch.float16]


def test_dump_state_logs_what_the_engine_was_built_from(caplog):
    with caplog.at_level("INFO", logger="zkit"):
        _engine(dump_state=True)
    assert "engine state: world size 1" in caplog.text and '"dump_state": true' in caplog.text


def test_a_key_without_effect_warns_once_naming_it_and_why(caplog):
    from zkit.core.config import load_config
    from zkit.core.config import structure as structure_module

    structure_module._WARNED.discard("zero_optimization.allgather_bucket_size")
    with caplog.at_level("WARNING", logger="zkit"):
        for _ in range(2):
            load_config({"train_batch_size": 2, "zero_optimization": {"allgather_bucket_size": 1000}}, world_size=1)
    lines = [r.getMessage() for r in caplog.records if "allgather_bucket_size" in r.getMessage()]
    assert lines == ["config key 'zero_optimization.allgather_bucket_size' = 1000 has no effect in zkit: zkit "
                     "all-gathers each unit (sized by reduce_bucket_size) in place into the parameters' own flat "
                     "buffer, so there is no gather buffer for this to size"]


@pytest.mark.parametrize("key,section", [("ignore_unused_parameters", "zero_optimization"),
                                         ("load_from_fp32_weights", "zero_optimization"),
                                         ("use_node_local_storage", "checkpoint")])
def test_a_key_zkit_cannot_honour_is_refused(key, section):
    from zkit.core.config import load_config

    value = key == "use_node_local_storage"
    with pytest.raises(NotImplementedConfigError, match=f"config key '{section}.{key}' is set to {value}, but zkit "
                                                         "does not implement this feature yet"):
        load_config({"train_batch_size": 2, section: {key: value}}, world_size=1)


def test_stage3_model_persistence_threshold_caps_the_persistent_units():
    from hypothesis import given
    from hypothesis import strategies as st

    from tests import engine_ranks as er
    from zkit.zero.flat import persistent_units

    assert persistent_units([12, 42, 78], 100, 60) == [True, True, False]

    @given(st.lists(st.integers(0, 200), max_size=20), st.integers(0, 150), st.integers(0, 500))
    def within_both_thresholds(numels, param_threshold, model_threshold):
        keep = persistent_units(numels, param_threshold, model_threshold)
        assert sum(n for n, k in zip(numels, keep) if k) <= model_threshold
        assert all(n <= param_threshold for n, k in zip(numels, keep) if k)

    within_both_thresholds()
    for cap, expected in ((10**9, [True, True, True]), (60, [True, True, False])):
        cfg = er.config(3, "fp32", 1, 1)
        # one unit a module, so that the three parameters are three units to choose among
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=100, stage3_model_persistence_threshold=cap,
                                        stage3_gather_unit="module")
        engine = zkit.initialize(model=er.make_model(), config=cfg)[0]
        assert sorted(su.unit.numel for su in engine.partitioner.sharded) == [12, 42, 78]
        by_size = {su.unit.numel: su.persistent for su in engine.partitioner.sharded}
        assert [by_size[n] for n in (12, 42, 78)] == expected
        engine.close()
