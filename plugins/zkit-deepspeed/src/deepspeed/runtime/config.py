"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, a validated config with DeepSpeed's
attribute names, read from :class:`zkit.core.config.ZkitConfig`."""
from __future__ import annotations

from typing import Any

from zkit.core.config import ConfigError, ZkitConfig, load_config
from zkit.zero import zero_config

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError

# DeepSpeed's names of the optimizer types a config's "optimizer.type" may take (lower case)
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER = "onebitadam", "zerooneadam", "onebitlamb"
MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER = "muadam", "muadamw", "musgd", "lion"


class DeepSpeedConfig:
    """``DeepSpeedConfig(config, mpu=None)``: ``config`` a dict or a JSON path, validated for the
    current data-parallel world (the process group's size once initialised, else 1).

    The attributes scripts read: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps``, ``gradient_clipping``, ``steps_per_print``, ``zero_enabled``,
    ``zero_optimization_stage``, ``fp16_enabled``, ``bfloat16_enabled``, ``optimizer_name``,
    ``optimizer_params``, ``scheduler_name``, ``scheduler_params``, ``wall_clock_breakdown``;
    ``zkit_config`` is the whole :class:`~zkit.core.config.ZkitConfig`."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise ValueError("DeepSpeedConfig: mpu= and mesh_device= are not supported: model-parallel groups come "
                             "from zkit-pipeline's topology")
        import torch.distributed as dist

        from zkit.core.plugin_manager import get_plugin_manager

        world = dist.get_world_size() if dist.is_initialized() else 1
        self.zkit_config: ZkitConfig = load_config(config, world_size=world,
                                                   sections=get_plugin_manager().config_sections())
        c = self.zkit_config
        self._param_dict = dict(c.raw)
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.gradient_clipping = c.gradient_clipping
        self.steps_per_print = c.steps_per_print
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.zero_optimization_stage = zero_config(c).stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = bool(c.fp16.enabled)
        self.bfloat16_enabled = bool(c.bf16.enabled)
        self.optimizer_name = c.optimizer.type.lower() if c.optimizer is not None else None
        self.optimizer_params = dict(c.optimizer.params) if c.optimizer is not None else None
        self.scheduler_name = c.scheduler.type if c.scheduler is not None else None
        self.scheduler_params = dict(c.scheduler.params) if c.scheduler is not None else None
        self.world_size = world

    def print(self, name: str) -> None:
        print(f"{name}:")
        for key, value in sorted(self._param_dict.items()):
            print(f"  {key} = {value!r}")
