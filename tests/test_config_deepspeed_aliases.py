"""DeepSpeed's other names for config keys: each one sets the key it names, as in DeepSpeed
0.19.8 (its pydantic models accept a field by its name and by its alias; ``aio.thread_count`` is
the older name of ``aio.intra_op_parallelism``). Both names at once, and typos, are refused."""
from __future__ import annotations

import pytest

from zkit.core.config import ConfigError, load_config
from zkit.core.plugin_manager import get_plugin_manager
from zkit.zero.config import zero_config

#: DeepSpeed's field name -> zkit's key (DeepSpeed's alias), zero_optimization
ZERO_SHORT_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}


def _load(config: dict):
    return load_config({"train_batch_size": 2, **config}, world_size=1,
                       sections=get_plugin_manager().config_sections())


def _value(new: str):
    """A value other than the default, of the key's type."""
    default = getattr(zero_config(_load({})), new)
    return (not default) if isinstance(default, bool) else 12_345


@pytest.mark.parametrize("old, new", ZERO_SHORT_NAMES.items())
def test_zero_field_names_set_the_stage3_keys(old, new):
    value = _value(new)
    config = _load({"zero_optimization": {"stage": 3, old: value}})
    assert getattr(zero_config(config), new) == value


def test_zero_field_name_and_alias_together_are_refused():
    with pytest.raises(ConfigError, match="config keys 'zero_optimization.prefetch_bucket_size' and "
                                          "'zero_optimization.stage3_prefetch_bucket_size' are both given"):
        _load({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


def test_aio_thread_count_sets_intra_op_parallelism():
    pytest.importorskip("zkit_offload")
    config = _load({"aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                            "overlap_events": True, "thread_count": 3}})
    aio = config.plugin_sections["aio"]
    assert aio.intra_op_parallelism == 3 and aio.io_threads == 24
    with pytest.raises(ConfigError, match="config keys 'aio.thread_count' and 'aio.intra_op_parallelism' are both "
                                          "given; 'thread_count' is the old name of 'intra_op_parallelism'"):
        _load({"aio": {"thread_count": 1, "intra_op_parallelism": 2}})


def test_lightnings_default_config_loads():
    """What ``lightning.pytorch.strategies.DeepSpeedStrategy`` builds for "deepspeed_stage_2"."""
    pytest.importorskip("zkit_offload")
    config = _load({
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False},
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                              "allgather_partitions": True, "reduce_scatter": True, "allgather_bucket_size": 200000000,
                              "reduce_bucket_size": 200000000, "sub_group_size": 1000000000000},
        "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
    })
    assert zero_config(config).stage == 2 and config.plugin_sections["aio"].intra_op_parallelism == 1


@pytest.mark.parametrize("config, message", [
    ({"aio": {"thread_cont": 1}}, "unknown config key 'aio.thread_cont'; did you mean 'aio.thread_count'?"),
    ({"zero_optimization": {"prefetch_bucket_sise": 1}}, "unknown config key 'zero_optimization.prefetch_bucket_sise'; "
                                                         "did you mean 'zero_optimization.prefetch_bucket_size'?"),
    ({"zero_optimization": {"max_live_param": 1}}, "unknown config key 'zero_optimization.max_live_param'; "
                                                   "did you mean 'zero_optimization.max_live_parameters'?"),
])
def test_typos_stay_refused_with_the_closest_key(config, message):
    pytest.importorskip("zkit_offload")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("?", r"\?")):
        _load(config)
