"""Training sections: precision, optimizer, LR schedule, activation checkpointing, checkpoints."""
from typing import ClassVar

import attrs

from zkit.core.config.fields import DTYPE_NAMES, above, at_least, normalize_dtype, one_of, setting, upper


@attrs.frozen(kw_only=True)
class FP16Config:
    """Mixed precision with float16 weights and a loss scaler."""

    enabled: bool = setting(False, doc="Train in float16.")
    auto_cast: bool = setting(False, doc="Cast the model's inputs to float16.")
    loss_scale: float = setting(
        0.0, check=at_least(0), doc="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: int = setting(
        16, check=at_least(0), doc="Dynamic scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: int = setting(
        1000, check=at_least(1), doc="Steps without overflow before the scale is raised."
    )
    hysteresis: int = setting(2, check=at_least(1), doc="Overflows tolerated before lowering.")
    consecutive_hysteresis: bool = setting(
        False, doc="Refill the hysteresis budget after each step without overflow."
    )
    min_loss_scale: float = setting(1.0, check=above(0), doc="Lowest dynamic loss scale.")
    fp16_master_weights_and_grads: bool = setting(
        False, unimplemented=True, doc="Keep master weights and gradients in float16."
    )


@attrs.frozen(kw_only=True)
class BF16Config:
    """Mixed precision with bfloat16 weights (no loss scaling needed). DeepSpeed's old section
    name ``bfloat16`` is accepted."""

    enabled: bool = setting(False, doc="Train in bfloat16.")
    immediate_grad_update: bool = setting(
        True,
        doc="Apply gradients to the fp32 master copy as soon as they are reduced.",
        hint="zkit accumulates into the fp32 partition as each bucket is reduced",
    )


@attrs.frozen(kw_only=True)
class AmpConfig:
    """NVIDIA Apex AMP. Every key besides ``enabled`` is an ``amp.initialize`` argument."""

    #: keys other than ``enabled`` are collected into this field (they are Apex's arguments)
    extra_keys_into: ClassVar[str] = "options"

    enabled: bool = setting(False, unimplemented=True, doc="Use Apex AMP.")
    options: dict = setting(
        attrs.Factory(dict), default_doc="{}", doc="Other keys: arguments of amp.initialize."
    )


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """``{"type": name, "params": {...}}``. ``type`` selects an optimizer record
    (case-insensitive); ``params`` are checked by that optimizer's factory."""

    type: str = setting(doc="Optimizer name, e.g. Adam, AdamW, SGD, OneBitAdam.")
    params: dict = setting(
        attrs.Factory(dict), default_doc="{}", doc="Keyword arguments of the optimizer."
    )


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """``{"type": name, "params": {...}}`` for a learning-rate schedule."""

    type: str = setting(doc="Schedule name, e.g. WarmupLR, WarmupDecayLR, OneCycle.")
    params: dict = setting(
        attrs.Factory(dict), default_doc="{}", doc="Keyword arguments of the schedule."
    )


@attrs.frozen(kw_only=True)
class DataTypesConfig:
    """Data types of internal buffers."""

    grad_accum_dtype: str | None = setting(
        None,
        check=one_of(DTYPE_NAMES),
        edge=normalize_dtype,
        doc="Gradient accumulation dtype: fp32, fp16 or bf16 (null: the training dtype).",
    )


@attrs.frozen(kw_only=True)
class ActivationCheckpointingConfig:
    """Settings of ``zkit.activations.checkpointing.checkpoint`` (activation recomputation)."""

    partition_activations: bool = setting(
        False, doc="Split checkpointed activations across model-parallel ranks."
    )
    cpu_checkpointing: bool = setting(
        False, doc="Keep checkpointed activations in host memory."
    )
    contiguous_memory_optimization: bool = setting(
        False, doc="Copy checkpointed activations into one preallocated buffer."
    )
    number_checkpoints: int | None = setting(
        None, check=at_least(1), doc="Checkpoints per forward (sizes that buffer)."
    )
    synchronize_checkpoint_boundary: bool = setting(
        False, doc="Synchronize the device at each checkpoint boundary."
    )
    profile: bool = setting(False, doc="Time the forward and recompute of checkpoints.")


@attrs.frozen(kw_only=True)
class ParallelWriteConfig:
    """Which ranks write checkpoint files."""

    pipeline_stage: bool = setting(
        False,
        doc="Each pipeline stage writes its own files.",
        hint="every zkit rank already writes its own file, and each pipeline part its own directory",
    )


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """Saving and loading checkpoints."""

    tag_validation: str = setting(
        "WARN",
        check=one_of(("WARN", "IGNORE", "FAIL")),
        edge=upper,
        doc="What to do when ranks save with different tags: Warn, Ignore or Fail.",
    )
    load_universal: bool = setting(
        False,
        doc="Load a DeepSpeed universal checkpoint.",
        hint="zkit checkpoints are always world-size independent, so there is nothing to convert",
    )
    use_node_local_storage: bool = setting(
        False,
        unimplemented=True,
        doc="Every node writes its ranks' files to local storage (zkit needs one shared directory: a "
        "rank reads back whichever files hold the ranges it owns, at any world size).",
    )
    parallel_write: ParallelWriteConfig = setting(
        attrs.Factory(ParallelWriteConfig), default_doc="{}", doc="Which ranks write files."
    )


__all__ = [
    "ActivationCheckpointingConfig",
    "AmpConfig",
    "BF16Config",
    "CheckpointConfig",
    "DataTypesConfig",
    "FP16Config",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "SchedulerConfig",
]

