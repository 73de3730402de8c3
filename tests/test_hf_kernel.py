"""What the Hugging Face integrations ask of the kernel (the flows themselves run in
plugins/zkit-deepspeed/tests/test_hf_flows.py): Accelerate's ``steps_per_print: inf``, a model
built inside ``zero.Init`` with a config whose "auto" values are not filled yet, and
``state_dict()`` of a partitioned model read for its keys and shapes."""
import json

import pytest
import torch

import zkit.zero
from zkit.core.config import ConfigError, load_config


def test_steps_per_print_infinity_means_never():
    # Accelerate's DeepSpeedPlugin writes float("inf") when the user sets nothing
    config = load_config({"train_batch_size": 2, "steps_per_print": float("inf")}, world_size=1)
    assert config.steps_per_print > 10**15
    for bad, message in ((0, "must be >= 1, got 0"), (float("-inf"), "must be an int, got -inf"),
                         (float("nan"), "must be an int, got nan"), (2.5, "must be an int, got 2.5")):
        with pytest.raises(ConfigError, match=f"config key 'steps_per_print' {message}"):
            load_config({"train_batch_size": 2, "steps_per_print": bad}, world_size=1)


def _hf_config_before_finalize() -> dict:
    """What transformers hands zero.Init during from_pretrained: batch and optimizer values
    filled, the scheduler's steps and the bucket sizes still "auto"."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
        "bf16": {"enabled": True},
        "steps_per_print": float("inf"),
    }


@pytest.mark.parametrize("as_file", (False, True))
def test_zero_init_ignores_auto_values_it_does_not_read(tmp_path, as_file):
    config = _hf_config_before_finalize()
    if as_file:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps({**config, "steps_per_print": 10}))
        config = str(path)
    with zkit.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(8, 4)
    assert getattr(layer.weight, "_zkit_unit", None) is not None and layer.weight.dtype == torch.bfloat16
    # the engine, which reads them, still wants them filled in
    with pytest.raises(ConfigError, match="'scheduler.params.warmup_num_steps' is \"auto\""):
        load_config(_hf_config_before_finalize(), world_size=1)


def test_zero_init_still_refuses_a_bad_config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage": 0}}')
    with pytest.raises(ConfigError, match="key 'stage' appears twice"):
        with zkit.zero.Init(config_dict_or_path=str(path)):
            torch.nn.Linear(2, 2)


def test_state_dict_of_a_partitioned_model_has_keys_and_shapes_not_values():
    torch.manual_seed(0)
    with zkit.zero.Init():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = model.state_dict()
    assert {k: (tuple(v.shape), v.device.type) for k, v in state.items()} == {
        "0.weight": ((3, 4), "meta"), "0.bias": ((3,), "meta"), "1.weight": ((2, 3), "meta"), "1.bias": ((2,), "meta")}
    # values are not there: loading them anywhere fails instead of copying garbage
    with pytest.raises(RuntimeError, match="0.weight"):
        torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).load_state_dict(state)
    # gathered, state_dict() has the values
    with zkit.zero.GatheredParameters(list(model.parameters())):
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(v.device.type == "cpu" and v.shape == state[k].shape for k, v in gathered.items())
    # computing with a released parameter is still the clear error it was
    with pytest.raises(RuntimeError, match="is partitioned by ZeRO stage 3 and not gathered here"):
        model[0].weight.sum()
