"""DeepSpeed-style configs, structured into frozen, validated attrs classes.

``load_config(source, world_size=..., sections=...)`` accepts a dict, a JSON file path or a
:class:`ZkitConfig`; every bad input raises :class:`ConfigError` naming the key. See
``docs/config.md`` for every key and default.
"""
from zkit.core.config.errors import ConfigError, NotImplementedConfigError
from zkit.core.config.load import load_config, read_config_file
from zkit.core.config.schema import ZkitConfig
from zkit.core.config.sections import (
    BF16Config,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
)

__all__ = [
    "BF16Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "NotImplementedConfigError",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZkitConfig",
    "load_config",
    "read_config_file",
]
