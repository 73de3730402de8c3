"""Training sections: precision, optimizer, LR schedule."""

import attrs

from zkit.core.config.fields import DTYPE_NAMES, above, at_least, normalize_dtype, one_of, setting


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
        doc="Gradient accumulation dtype: fp32, fp16 or bf16 (null: the training dtype). At ZeRO stages 2-3 the "
            "reduced gradient shards add the micro-steps in it (in fp32 training too: the step then takes their fp32 "
            "value); stages 0-1 accumulate in the parameters' own .grad and refuse any other than the training dtype.",
    )


__all__ = [
    "BF16Config",
    "DataTypesConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
]

