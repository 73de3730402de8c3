"""zkit.core.config: structuring, defaults, errors (each error's text is checked)."""
import json
import sys

import attrs
import pytest
import torch

from zkit.core.config import (
    ConfigError,
    NotImplementedConfigError,
    ZkitConfig,
    load_config,
)
from zkit.checkpoint.config import checkpoint_config
from zkit.monitor.config import monitor_sections
from zkit.zero.config import ZeroConfig, zero_config

BASE = {"train_batch_size": 8}


def load(extra=None, world_size=2, **kw):
    return load_config({**BASE, **(extra or {})}, world_size=world_size, **kw)


def error(extra, world_size=2, kind=ConfigError):
    with pytest.raises(kind) as info:
        load(extra, world_size=world_size)
    return str(info.value)


# -- accepted input -------------------------------------------------------------------------


def test_defaults_match_deepspeed():
    cfg = load()
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print == 10
    assert cfg.fp16 == cfg.fp16.__class__() and not cfg.fp16.enabled
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000
    assert cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1.0
    zero = zero_config(cfg)
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.overlap_comm is False and zero.offload_optimizer is None
    assert cfg.optimizer is None and cfg.scheduler is None
    assert monitor_sections(cfg).tensorboard.job_name == "zkit" and cfg.comms_timeout_s == 300.0
    assert cfg.dtype == torch.float32 and cfg.world_size == 2


def test_deepspeed_zero3_file(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "sub_group_size": 1e9, "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "none"}, "offload_param": None,
        },
        "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4},
        "checkpoint": {"tag_validation": "Fail"},
        "communication_data_type": "bfloat16",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(str(path), world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (32, 2, 4)
    assert cfg.gradient_clipping == 1.0 and isinstance(cfg.gradient_clipping, float)
    assert zero_config(cfg).sub_group_size == 1_000_000_000
    assert type(zero_config(cfg).sub_group_size) is int
    assert zero_config(cfg).offload_optimizer is None
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["betas"] == [0.9, 0.95]
    assert checkpoint_config(cfg).tag_validation == "FAIL"
    assert cfg.communication_data_type == "bf16"
    assert cfg.dtype == torch.float16
    assert cfg.raw == ds
    assert load_config(path, world_size=4) == cfg


def test_old_names():
    cfg = load({"bfloat16": {"enabled": True},
                "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.bf16.enabled and cfg.dtype == torch.bfloat16
    assert zero_config(cfg).stage3_gather_16bit_weights_on_model_save


def test_overlap_comm_default_follows_stage():
    assert zero_config(load({"zero_optimization": {"stage": 3}})).overlap_comm is True
    assert zero_config(load({"zero_optimization": {"stage": 2}})).overlap_comm is False
    assert ZeroConfig(stage=3, overlap_comm=False).overlap_comm is False


def test_to_dict_round_trip_and_json():
    cfg = load({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "amp": {"enabled": False, "opt_level": "O1"},
                "elasticity": {"micro_batch_sizes": [1, 2]}})
    d = cfg.to_dict()
    json.dumps(d)
    assert d["amp"] == {"enabled": False, "opt_level": "O1"}
    assert d["elasticity"]["micro_batch_sizes"] == [1, 2]
    assert load_config(d, world_size=2) == cfg
    d["optimizer"]["params"]["lr"] = 5.0  # to_dict hands out copies
    assert cfg.optimizer.params["lr"] == 1e-3


def test_existing_config_is_revalidated_for_world_size():
    cfg = load_config({"train_batch_size": 16}, world_size=2)
    again = load_config(cfg, world_size=4)
    assert again.train_micro_batch_size_per_gpu == 4 and again.world_size == 4
    with pytest.raises(ConfigError, match="not divisible by gradient_accumulation_steps 1"):
        load_config(cfg, world_size=3)


def test_input_is_not_modified_or_aliased():
    params = {"lr": 1.0}
    src = {**BASE, "optimizer": {"type": "SGD", "params": params}}
    cfg = load_config(src, world_size=1)
    params["lr"] = 2.0
    assert cfg.optimizer.params["lr"] == 1.0 and cfg.raw["optimizer"]["params"]["lr"] == 1.0


def test_classes_are_frozen():
    cfg = load()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.gradient_clipping = 1.0


@pytest.fixture
def plugins_not_installed(monkeypatch):
    """As on a machine where the plugin distributions are not installed."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name.startswith("zkit-"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_legacy_cpu_offload_without_plugin_names_the_distribution(plugins_not_installed):
    msg = error({"zero_optimization": {"cpu_offload": True}})
    assert msg == (
        "config key 'zero_optimization.offload_optimizer' (device 'cpu') is provided by the "
        "distribution 'zkit-offload', which is not installed: pip install zkit-offload"
    )
    assert zero_config(load({"zero_optimization": {"cpu_offload": False}})).offload_optimizer is None


# -- errors ---------------------------------------------------------------------------------


def test_unknown_key_suggests_closest():
    assert error({"zero_optimization": {"stge": 1}}) == (
        "unknown config key 'zero_optimization.stge'; did you mean 'zero_optimization.stage'?"
    )
    assert error({"fp61": {}}) == "unknown config key 'fp61'; did you mean 'fp16'?"


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = error({"checkpoint": {"xyzzy": 1}})
    assert msg == (
        "unknown config key 'checkpoint.xyzzy'; valid keys of 'checkpoint' are: "
        "load_universal, parallel_write, tag_validation, use_node_local_storage"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"fp16": {"loss_scale_window": "abc"}},
         "config key 'fp16.loss_scale_window' must be an int, got 'abc'"),
        ({"fp16": {"enabled": 1}}, "config key 'fp16.enabled' must be a bool (true or false), got 1"),
        ({"zero_optimization": {"stage": True}},
         "config key 'zero_optimization.stage' must be an int, got True"),
        ({"zero_optimization": {"reduce_bucket_size": 2.5}},
         "config key 'zero_optimization.reduce_bucket_size' must be an int, got 2.5"),
        ({"gradient_clipping": "1"}, "config key 'gradient_clipping' must be a number, got '1'"),
        ({"seed": 1.5}, "config key 'seed' must be an int or null, got 1.5"),
        ({"fp16": 1}, "config key 'fp16' must be a JSON object, got 1"),
        ({"optimizer": {"type": "Adam", "params": []}},
         "config key 'optimizer.params' must be a JSON object, got []"),
        ({"elasticity": {"micro_batch_sizes": [1, "x"]}},
         "config key 'elasticity.micro_batch_sizes' must be a list of ints, got [1, 'x']"),
    ],
)
def test_wrong_type(extra, message):
    assert error(extra) == message


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"zero_optimization": {"stage": 5}},
         "config key 'zero_optimization.stage' must be between 0 and 3, got 5"),
        ({"gradient_clipping": -1.0}, "config key 'gradient_clipping' must be >= 0, got -1.0"),
        ({"fp16": {"min_loss_scale": 0}}, "config key 'fp16.min_loss_scale' must be > 0, got 0.0"),
        ({"communication_data_type": "int8"},
         "config key 'communication_data_type' must be one of 'fp32', 'fp16', 'bf16', got 'int8'"),
        ({"checkpoint": {"tag_validation": "maybe"}},
         "config key 'checkpoint.tag_validation' must be one of 'WARN', 'IGNORE', 'FAIL', got 'MAYBE'"),
        ({"elasticity": {"micro_batch_sizes": [2, 0]}},
         "config key 'elasticity.micro_batch_sizes' must be >= 1, got 0"),
        ({"comms_timeout_s": 0}, "config key 'comms_timeout_s' must be > 0, got 0.0"),
    ],
)
def test_out_of_range(extra, message):
    assert error(extra) == message


def test_fp16_and_bf16_together():
    assert error({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == (
        "config keys 'fp16.enabled' and 'bf16.enabled' are both true; enable one of them"
    )


def test_old_and_new_name_together():
    assert error({"bf16": {}, "bfloat16": {}}) == (
        "config keys 'bfloat16' and 'bf16' are both given; 'bfloat16' is the old name of 'bf16': "
        "keep only 'bf16'"
    )


def test_auto_is_rejected_naming_the_key():
    msg = error({"zero_optimization": {"reduce_bucket_size": "auto"}})
    assert msg.startswith('config key \'zero_optimization.reduce_bucket_size\' is "auto": ')
    assert "resolve it before calling zkit" in msg
    assert error({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}).startswith(
        "config key 'scheduler.params.warmup_max_lr' is \"auto\""
    )
    with pytest.raises(ConfigError, match="config key 'train_micro_batch_size_per_gpu' is \"auto\""):
        load_config({"train_micro_batch_size_per_gpu": "auto"}, world_size=1)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
        ({"zero_optimization": {"mics_shard_size": 4}}, "zero_optimization.mics_shard_size"),
        ({"wandb": {"enabled": True}}, "wandb.enabled"),
        ({"comet": {"enabled": True}}, "comet.enabled"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler.enabled"),
        ({"amp": {"enabled": True, "opt_level": "O2"}}, "amp.enabled"),
        ({"elasticity": {"enabled": True}}, "elasticity.enabled"),
        ({"autotuning": {"enabled": True}}, "autotuning.enabled"),
        ({"hybrid_engine": {"enabled": True, "max_out_tokens": 512}}, "hybrid_engine.enabled"),
        ({"compression_training": {}}, "compression_training"),
    ],
)
def test_not_implemented(extra, key):
    msg = error(extra, kind=NotImplementedConfigError)
    assert msg.startswith(f"config key '{key}' is set to ")
    assert "zkit does not implement this feature yet" in msg


def test_not_implemented_message_text():
    assert error({"zero_optimization": {"zero_hpz_partition_size": 8}}, kind=NotImplementedConfigError) == (
        "config key 'zero_optimization.zero_hpz_partition_size' is set to 8, but zkit does not "
        "implement this feature yet (ZeRO++ hierarchical partitioning: ranks in the secondary "
        "group (>1 enables)); remove the key or set it to 1"
    )


def test_hybrid_engine_on_is_refused_naming_rlhf_generation():
    assert error({"hybrid_engine": {"enabled": True}}, kind=NotImplementedConfigError) == (
        "config key 'hybrid_engine.enabled' is set to True, but zkit does not implement this feature yet (RLHF "
        "generation with DeepSpeed's hybrid engine (inference kernels inside the training engine)); remove the key "
        "or set it to False"
    )


def test_not_implemented_keys_at_default_are_fine():
    cfg = load({"zero_optimization": {"zero_hpz_partition_size": 1, "zero_quantized_weights": False,
                                      "mics_shard_size": -1},
                "wandb": {"enabled": False, "project": "p"}, "amp": {"enabled": False},
                # DeepSpeed-Chat writes the hybrid engine's section, off, at every step
                "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                                  "release_inference_cache": False, "pin_parameters": True,
                                  "tp_gather_partition_size": 8}})
    assert cfg.section("wandb").project == "p"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sparse_attention": {"mode": "fixed"}},
         "config key 'sparse_attention' is provided by the distribution 'zkit-sparse', which is "
         "not installed: pip install zkit-sparse"),
        ({"pipeline": {"stages": 2}},
         "config key 'pipeline' is provided by the distribution 'zkit-pipeline', which is not "
         "installed: pip install zkit-pipeline"),
        ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
         "config key 'zero_optimization.offload_param' (device 'nvme') is provided by the "
         "distribution 'zkit-offload', which is not installed: pip install zkit-offload"),
        ({"aio": {"block_size": 1048576}},
         "config key 'aio' is provided by the distribution 'zkit-offload', which is not "
         "installed: pip install zkit-offload"),
    ],
)
def test_plugin_key_without_plugin(extra, message, plugins_not_installed):
    assert error(extra) == message


def test_plugin_key_of_an_installed_distribution_that_registered_no_section():
    # loaded without the plugins' sections (a blocked plugin), while zkit-sparse is installed
    pytest.importorskip("zkit_sparse")
    assert error({"sparse_attention": {"mode": "fixed"}}).startswith(
        "config key 'sparse_attention' is provided by the distribution 'zkit-sparse', which is installed "
        "(version ")


def test_legacy_offload_conflicts():
    assert error({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}) == (
        "config keys 'zero_optimization.cpu_offload' and 'zero_optimization.offload_optimizer' "
        "are both given; 'cpu_offload' is the deprecated form of 'offload_optimizer': keep only "
        "'offload_optimizer'"
    )
    assert error({"zero_optimization": {"cpu_offload_use_pin_memory": True}}).startswith(
        "config key 'zero_optimization.cpu_offload_use_pin_memory' has an effect only with"
    )


def test_conflicting_grad_accum_dtypes():
    assert error({"gradient_accumulation_dtype": "fp32", "data_types": {"grad_accum_dtype": "bf16"}}) == (
        "config keys 'gradient_accumulation_dtype' ('fp32') and 'data_types.grad_accum_dtype' "
        "('bf16') disagree; set one of them"
    )
    assert load({"gradient_accumulation_dtype": "float32"}).grad_accum_dtype == "fp32"


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="a config must be a dict, a path to a JSON file or a ZkitConfig, got int"):
        load_config(3, world_size=1)
    with pytest.raises(ConfigError, match="config file '.*missing.json' does not exist"):
        load_config(tmp_path / "missing.json", world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match="config file '.*bad.json' is not valid JSON: .* at line 1 column 24"):
        load_config(bad, world_size=1)
    arr = tmp_path / "arr.json"
    arr.write_text("[1]")
    with pytest.raises(ConfigError, match=r"the config must be a JSON object, got \[1\]"):
        load_config(arr, world_size=1)
    with pytest.raises(ConfigError, match="world_size must be an int >= 1, got 0"):
        load_config(BASE, world_size=0)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="config key 'stage' must be between 0 and 3, got 4"):
        ZeroConfig(stage=4)
    with pytest.raises(ConfigError, match="config key 'train_batch_size' must be an int, got '8'"):
        ZkitConfig(train_batch_size="8", train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)


def test_duplicate_keys_in_a_file_are_refused(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage": 0}}')
    with pytest.raises(
        ConfigError, match=r"config file '.*dup.json': key 'stage' appears twice in one object \(values 3 and 0\); keep one"
    ):
        load_config(dup, world_size=1)
    top = tmp_path / "top.json"
    top.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="key 'train_batch_size' appears twice"):
        load_config(top, world_size=1)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    latin = tmp_path / "latin1.json"
    latin.write_bytes('{"train_batch_size": 8, "comment": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"config file '.*latin1.json' is not UTF-8 text: byte 0xe9 at offset 39"):
        load_config(latin, world_size=1)
