"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum`` and ``DeepSpeedZeroConfig``, DeepSpeed's pydantic
model of the ``zero_optimization`` section, for code that builds or reads one (transformers and
DeepSpeed's tests do). It validates as DeepSpeed's does (aliases such as
``stage3_prefetch_bucket_size``, deprecated keys moved to their replacements, unknown keys
refused); the engine itself reads the section through :mod:`zkit.core.config`.
"""
from __future__ import annotations

import enum
import sys
from typing import Any, Dict, Optional

from pydantic import Field, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, pp_int
from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
from deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from deepspeed.utils import logger

__all__ = ["DeepSpeedZeroConfig", "ZERO_OPTIMIZATION", "ZeroStageEnum", "get_zero_config"]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, enum.Enum):
    """The ZeRO stages by what they partition."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _deprecated(new: str, fn: Any = None, move: bool = True) -> Any:
    extra: dict[str, Any] = {"deprecated": True, "new_param": new, "set_new_param": move}
    if fn is not None:
        extra["new_param_fn"] = fn
    return Field(None, json_schema_extra=extra)


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """The ``zero_optimization`` section, with DeepSpeed 0.19.8's fields and defaults (checked against the
    installed DeepSpeed by ``plugins/zkit-deepspeed/tests/test_deepspeed_names.py``)."""

    stage: ZeroStageEnum = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(pp_int(5e8), ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(pp_int(5e8), ge=0)
    overlap_comm: Optional[bool] = None  # None: True at stage 3, else False (set after validation)
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    zenflow: Optional[Dict[str, Any]] = None
    sub_group_size: int = Field(pp_int(1e9), ge=0)
    cpu_offload_param: Optional[bool] = _deprecated(
        "offload_param", lambda on: DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu) if on else None)
    cpu_offload_use_pin_memory: Optional[bool] = _deprecated("offload_param or offload_optimizer", move=False)
    cpu_offload: Optional[bool] = _deprecated(
        "offload_optimizer",
        lambda on: DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu) if on else None)
    prefetch_bucket_size: int = Field(pp_int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(pp_int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(pp_int(sys.maxsize, "sys.maxsize"), ge=0,
                                             alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(pp_int(1e9), ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(pp_int(1e9), ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(pp_int(0), alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(default=False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = Field(
        False, json_schema_extra={"deprecated": True, "new_param": "gather_16bit_weights_on_model_save"})
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    @field_validator("offload_param", "offload_optimizer", mode="before")
    @classmethod
    def _offload_from_dict(cls, value: Any, info: Any) -> Any:
        # the offload sections' classes are attrs classes (zkit's), built here from their dicts
        if isinstance(value, dict):
            target = (DeepSpeedZeroOffloadParamConfig if info.field_name == "offload_param"
                      else DeepSpeedZeroOffloadOptimizerConfig)
            return target(**value)
        return value

    @model_validator(mode="after")
    def _overlap_comm_default(self) -> "DeepSpeedZeroConfig":
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == ZeroStageEnum.weights
        return self

    @model_validator(mode="after")
    def _grad_norm_only_at_stages_1_2(self) -> "DeepSpeedZeroConfig":
        if not self.compute_grad_norm and self.stage not in (ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients):
            raise ValueError("compute_grad_norm=false is supported only with ZeRO Stage 1 or 2")
        return self

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self) -> "DeepSpeedZeroConfig":
        ratio = getattr(self.offload_optimizer, "ratio", 1.0)
        if self.offload_optimizer is not None and ratio < 1.0 and self.stage != ZeroStageEnum.weights:
            raise ValueError("Partial offloading only supported for ZeRO Stage 3.")
        return self

    @model_validator(mode="after")
    def _elastic_checkpoint_note(self) -> "DeepSpeedZeroConfig":
        if self.stage == ZeroStageEnum.weights and self.elastic_checkpoint:
            logger.warning("ZeRO-3 elastic checkpointing is deprecated and no longer supported. "
                           "Use Universal Checkpointing instead.")
        return self


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` section of a whole config dict (``{}`` when absent). DeepSpeed's
    older boolean form (``"zero_optimization": true``) means stage 1."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        logger.warning("zero_optimization as a boolean is deprecated: give {\"stage\": N}")
        section = {"stage": 1 if section else 0}
    return DeepSpeedZeroConfig(**section)
