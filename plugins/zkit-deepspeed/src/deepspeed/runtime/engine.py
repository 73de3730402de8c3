"""``deepspeed.runtime.engine``: ``DeepSpeedEngine``, the class ``deepspeed.initialize`` returns an
instance of: :class:`zkit.core.engine.Engine` plus the accessors only DeepSpeed code reads (ranks,
the precision flags, ``steps_per_print``, ``tput_timer``), the ``zero_to_fp32.py`` script DeepSpeed
copies into each checkpoint folder, and DeepSpeed's fallback of an unknown
attribute to the wrapped module (``engine.config`` of a Hugging Face model is the engine's; its
``engine.model``, ``engine.gradient_checkpointing_enable()`` are the module's). zkit's own engine
keeps the accessors zkit itself uses (``zero_optimization_stage``, ``train_batch_size``,
``get_lr``, ...)."""
from __future__ import annotations

import functools
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from zkit.core.engine import Engine
from zkit.zero import zero_config
from deepspeed.utils.timer import ThroughputTimer
from zkit_deepspeed.sequence_mpu import ReplicaAveragedMicroStep, building_mpu

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(Engine):
    """zkit's engine under DeepSpeed's name, with DeepSpeed's remaining accessors."""

    def __getattr__(self, name: str) -> Any:
        # DeepSpeed's engine answers what it lacks from the module it wraps (DeepSpeed-Chat reads
        # engine.model every step); the engine's own names, parameters and submodules come first
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, nor has the "
                                     f"module it wraps ({type(module).__name__})") from None

    @functools.cached_property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput counters of this engine (:class:`deepspeed.utils.timer.ThroughputTimer`)."""
        return ThroughputTimer(self)

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job."""
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's ``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: DeepSpeed's model-parallel unit: its sequence-parallel groups (``parallel_state_sp``) or None
        self.mpu = building_mpu()
        if self.mpu is not None and self.zero_optimization_stage() < 3:
            # DeepSpeed's gradient under its sequence groups at stages 0-2: summed over every rank,
            # divided by the data-parallel replicas only (zkit_deepspeed.sequence_mpu says what that is)
            self.micro_step_protocol = ReplicaAveragedMicroStep(self, self.config.sequence_parallel_size)

    @property
    def dp_world_size(self) -> int | None:
        """DeepSpeed's: the ranks ZeRO partitions over, or ``None`` when the engine was built with
        ``mpu=`` DeepSpeed's sequence-parallel groups (DeepSpeed asks such an mpu for no
        data-parallel size). The batch sizes' replicas are ``world / sequence_parallel_size``."""
        return None if self.mpu is not None else self.world_size

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks ZeRO partitions over: every data and sequence-parallel rank."""
        return self.world_size

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks that split each sequence (1 without sequence parallelism)."""
        return self.config.sequence_parallel_size

    def get_sequence_parallel_group(self) -> Any:
        """The process group of the ranks that split each sequence with this one."""
        if self.sequence_parallel_group is None:
            raise AttributeError("this engine has no sequence-parallel group: sequence_parallel_size is 1")
        return self.sequence_parallel_group

    @property
    def mp_world_size(self) -> int:
        """The ranks one replica spans (pipeline x tensor parallel; 1 without model parallelism)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return world // self.world_size

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """zkit's save, with DeepSpeed's keys beside the weights in the client state
        (:mod:`zkit_deepspeed.model_state_keys`: ``load_checkpoint`` returns them as DeepSpeed's
        does); then, as DeepSpeed does for ZeRO (and bf16) checkpoints, rank 0 copies
        ``zero_to_fp32.py`` into ``save_dir``: ``python <save_dir>/zero_to_fp32.py <save_dir> <out>``
        writes the fp32 weights. Every rank raises if the copy failed."""
        from zkit_deepspeed.model_state_keys import deepspeed_model_state_keys

        # DeepSpeed's keys beside the weights, then the client's (which win, as in DeepSpeed)
        state = {**deepspeed_model_state_keys(self, exclude_frozen_parameters), **(client_state or {})}
        where = super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
        if self.zero_optimization_stage() > 0 or self.bfloat16_enabled():
            error = None
            if self.global_rank == 0:
                try:
                    _copy_recovery_script(Path(save_dir))
                except OSError as exc:
                    error = f"{type(exc).__name__}: {exc}"
            comm = self.world_comm
            errors = comm.all_gather_object(error) if comm.world_size > 1 else [error]
            failed = next((e for e in errors if e), None)
            if failed:
                raise OSError(f"save_checkpoint: the checkpoint was saved in {save_dir}, but copying zero_to_fp32.py "
                              f"there failed on rank 0 ({failed})")
        return where

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


def _copy_recovery_script(save_dir: Path) -> None:
    from zkit_deepspeed import zero_to_fp32_script

    target = save_dir / "zero_to_fp32.py"
    shutil.copyfile(zero_to_fp32_script.__file__, target)
    target.chmod(target.stat().st_mode | stat.S_IEXEC)
