"""Inputs that used to train on wrongly or fail without saying where, each refused with a message:
an fp16 loss scale that overflows every step, a gradient_predivide_factor that does, a ``latest``
file that is not a tag; and NumPy or 0-d tensor numbers in a Python config, accepted as DeepSpeed
accepts them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import zkit
from zkit.checkpoint import CheckpointError
from zkit.core.config import ConfigError, load_config


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "steps_per_print": 1000, **extra}


def _engine(config):
    torch.manual_seed(0)
    return zkit.initialize(model=torch.nn.Linear(4, 2), config=config)[0]


def _step(engine) -> None:
    loss = engine(torch.ones(2, 4, dtype=engine.dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def test_a_static_fp16_loss_scale_that_overflows_every_step_stops_the_job(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "nonfinite_steps_limit": 2, '
                    '"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, '
                    '"fp16": {"enabled": true, "loss_scale": Infinity}}')
    engine = _engine(str(path))
    _step(engine)
    _step(engine)
    assert engine.skipped_steps == 2 and not engine.was_step_applied()
    with pytest.raises(FloatingPointError) as err:
        _step(engine)
    assert str(err.value) == (
        "step 3: fp16 gradients overflowed for 3 steps in a row with the static loss scale inf (fp16.loss_scale; "
        "nonfinite_steps_limit is 2); training stopped. Lower fp16.loss_scale, set it to 0 for dynamic loss "
        "scaling, or train in bf16")


def test_a_static_fp16_loss_scale_that_overflows_now_and_then_trains_on():
    engine = _engine(_config(nonfinite_steps_limit=1, fp16={"enabled": True, "loss_scale": 128.0}))
    for _ in range(4):
        _step(engine)
        assert engine.was_step_applied()


@pytest.mark.parametrize("factor", [1e308, 1e-300, float("inf")])
def test_gradient_predivide_factor_out_of_range_is_refused_at_load(factor):
    with pytest.raises(ConfigError) as err:
        load_config(_config(gradient_predivide_factor=factor), world_size=2)
    assert str(err.value) == (
        f"config key 'gradient_predivide_factor' must be between 1e-06 and 1000000.0, got {factor!r}")
    assert load_config(_config(gradient_predivide_factor=2.0), world_size=2).gradient_predivide_factor == 2.0


@pytest.mark.parametrize("lr", [np.float32(0.01), np.float64(0.01), torch.tensor(0.01), np.array(0.01)],
                         ids=["np.float32", "np.float64", "0-d tensor", "0-d array"])
def test_numpy_and_0d_tensor_numbers_in_a_python_config_are_plain_numbers(lr):
    config = _config(gradient_clipping=np.float32(1.0), gradient_accumulation_steps=np.int64(1))
    config["optimizer"]["params"]["lr"] = lr
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": lr, "warmup_num_steps": np.int32(2)}}
    engine = _engine(config)
    _step(engine)
    assert engine.was_step_applied()
    assert type(engine.config.optimizer.params["lr"]) is float
    assert engine.config.optimizer.params["lr"] == pytest.approx(0.01)
    assert type(engine.config.gradient_clipping) is float and engine.config.gradient_accumulation_steps == 1
    json.dumps(engine.config.raw)  # plain numbers throughout


def test_a_tensor_with_elements_is_still_refused():
    config = _config()
    config["optimizer"]["params"]["lr"] = torch.tensor([0.01, 0.02])
    with pytest.raises(ValueError) as err:
        _engine(config)
    assert str(err.value) == "optimizer 'adamw': lr must be a finite number, got tensor([0.0100, 0.0200])"


@pytest.mark.parametrize("content,problem", [
    (b"global_step1\x00", "holds a NUL byte (at offset 12)"),
    (b"global_step1\xff", "not UTF-8 text (byte 0xff at offset 12)"),
])
def test_a_latest_file_that_is_not_a_tag_is_refused_naming_it(tmp_path, content, problem):
    engine = _engine(_config())
    _step(engine)
    engine.save_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(str(tmp_path))
    assert str(err.value) == (
        f"{tmp_path / 'latest'}: {problem}; it should hold the tag of the latest checkpoint: rewrite it, or pass "
        f"tag= to load a specific checkpoint")
    engine.load_checkpoint(str(tmp_path), tag="global_step1")  # the checkpoint itself is fine
