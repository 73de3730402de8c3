"""``deepspeed.runtime.engine``: ``DeepSpeedEngine``, the class ``deepspeed.initialize`` returns an
instance of: :class:`zkit.core.engine.Engine` plus the accessors only DeepSpeed code reads (ranks,
the precision flags, ``steps_per_print``). zkit's own engine keeps the accessors zkit itself uses
(``zero_optimization_stage``, ``train_batch_size``, ``get_lr``, ...)."""
from __future__ import annotations

import os

import torch

from zkit.core.engine import Engine
from zkit.zero.config import zero_config

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(Engine):
    """zkit's engine under DeepSpeed's name, with DeepSpeed's remaining accessors."""

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job."""
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's ``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def dp_world_size(self) -> int:
        """The number of data-parallel replicas."""
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        """The ranks one replica spans (pipeline x tensor parallel; 1 without model parallelism)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return world // self.world_size

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ZeRO-3 saves gather the 16-bit weights (``stage3_gather_16bit_weights_on_model_save``)."""
        return bool(zero_config(self.config).stage3_gather_16bit_weights_on_model_save)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def steps_per_print(self) -> int:
        return self.config.steps_per_print
