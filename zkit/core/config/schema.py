""":class:`ZkitConfig`, the whole structured config. Keys and defaults follow DeepSpeed's
``ds_config.json``; ``seed`` and ``comms_timeout_s`` are zkit's own."""
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from zkit.core.config.errors import ConfigError
from zkit.core.config.fields import (
    DTYPE_NAMES,
    above,
    at_least,
    between,
    internal,
    normalize_dtype,
    one_of,
    setting,
)
from zkit.core.config.sections import (
    BF16Config,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
)
from zkit.core.config.structure import unstructure


def never_for_infinity(value: Any) -> Any:
    """Accelerate's DeepSpeed plugin sets ``steps_per_print`` to ``float("inf")`` (never): an
    interval no run reaches."""
    return sys.maxsize if isinstance(value, float) and value == float("inf") else value


if TYPE_CHECKING:  # pragma: no cover
    import torch


def _section(cls: type, doc: str) -> Any:
    return setting(attrs.Factory(cls), default_doc="{}", doc=doc)


@attrs.frozen(kw_only=True)
class ZkitConfig:
    """A validated config. Build it with ``zkit.core.config.load_config``; the three batch sizes
    are always resolved (see "Batch size" above)."""

    #: old section names DeepSpeed still reads -> the current names
    key_aliases: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}

    train_batch_size: int = setting(
        check=at_least(1), doc="Global batch: micro-batch * accumulation steps * world size."
    )
    train_micro_batch_size_per_gpu: int = setting(
        check=at_least(1), doc="Samples per rank per forward/backward."
    )
    gradient_accumulation_steps: int = setting(
        check=at_least(1), doc="Micro-batches per optimizer step."
    )
    gradient_clipping: float = setting(
        0.0, check=at_least(0), doc="Clip the global gradient norm to this (0: off)."
    )
    steps_per_print: int = setting(
        10, check=at_least(1), edge=never_for_infinity, doc="Log every this many steps."
    )
    wall_clock_breakdown: bool = setting(False, doc="Time forward, backward and step.")
    memory_breakdown: bool = setting(
        False, doc="Log the step line and the per-rank memory line at every step, not only every steps_per_print."
    )
    dump_state: bool = setting(False, doc="Print the engine's state after initialization.")
    prescale_gradients: bool = setting(
        False, doc="Divide gradients by the world size before reducing them."
    )
    gradient_predivide_factor: float = setting(
        1.0,
        # gradients are multiplied by 1/factor before the reduction and factor/world after it:
        # outside this range one of the two underflows or overflows the reduction's dtype
        check=between(1e-6, 1e6),
        doc="Divide gradients by this before reducing, the rest after.",
    )
    communication_data_type: str | None = setting(
        None,
        check=one_of(DTYPE_NAMES),
        edge=normalize_dtype,
        doc="Dtype of gradient reductions: fp32, fp16 or bf16 (also float32, bfloat16...; "
        "null: the training dtype).",
    )
    gradient_accumulation_dtype: str | None = setting(
        None,
        check=one_of(DTYPE_NAMES),
        edge=normalize_dtype,
        doc="Same as data_types.grad_accum_dtype.",
    )
    sparse_gradients: bool = setting(
        False, unimplemented=True, doc="Reduce embedding gradients as sparse tensors."
    )
    sequence_parallel_size: int = setting(
        1,
        check=at_least(1),
        doc="Ranks that split each sequence between them (Ulysses sequence parallelism, DeepSpeed's key): ranks "
        "r * size .. r * size + size - 1 hold one sequence's slices, and the batch sizes count world / size "
        "data-parallel replicas. Above 1 it needs a plugin providing sequence parallelism (zkit-sequence).",
    )
    dataloader_drop_last: bool = setting(
        False, doc="Drop the last incomplete batch of engine-built data loaders."
    )
    seed: int | None = setting(
        None, check=at_least(0), doc="Seed torch, numpy and random on every rank (zkit)."
    )
    nonfinite_steps_limit: int = setting(
        10,
        check=at_least(0),
        doc="Consecutive bf16/fp32 steps with a non-finite loss, gradient or gradient norm, or fp16 steps that "
        "overflow with a static loss scale (each skipped with a warning), before the job stops with an error; 0 "
        "stops at the first (zkit). A dynamic fp16 loss scale stops at fp16.min_loss_scale instead. bf16/fp32 "
        "verdicts stay on the device and are read every steps_per_print steps: the warnings and the stop (naming "
        "the step that crossed the limit) come then.",
    )
    comms_timeout_s: float = setting(
        300.0,
        check=above(0),
        doc="Seconds a collective may take before it is reported as hung (zkit).",
    )
    fp16: FP16Config = _section(FP16Config, "float16 mixed precision.")
    bf16: BF16Config = _section(BF16Config, "bfloat16 mixed precision (old name: bfloat16).")
    data_types: DataTypesConfig = _section(DataTypesConfig, "Internal buffer dtypes.")
    optimizer: OptimizerConfig | None = setting(None, doc="The optimizer (null: pass one in).")
    scheduler: SchedulerConfig | None = setting(None, doc="The LR schedule (null: none).")
    zero_allow_untested_optimizer: bool = setting(
        False,
        doc="Allow a client optimizer zkit has no record for under ZeRO.",
        hint="zkit runs any client optimizer under ZeRO: an elementwise one steps on shards, one that "
        "needs whole-parameter norms is refused at initialize",
    )
    zero_force_ds_cpu_optimizer: bool = setting(
        True,
        doc="With optimizer offload, require the CPU optimizer of zkit-offload.",
        hint="with offload_optimizer, zkit-offload always steps its own CPU optimizer",
    )
    compression_training: dict | None = setting(
        None,
        unimplemented=lambda v: v is not None,
        doc="DeepSpeed Compression (quantization/pruning during training).",
    )

    #: the data-parallel world size the batch sizes were resolved for (the ranks given to
    #: ``load_config`` divided by ``sequence_parallel_size``: the ranks of one sequence count once)
    world_size: int = internal(1)
    #: the dict the user gave, unchanged
    raw: dict = internal(attrs.Factory(dict))
    #: plugin-owned sections that were given, structured, by dotted path
    plugin_sections: dict = internal(attrs.Factory(dict))
    #: the plugin section records this config was loaded with, by dotted path
    section_records: dict = internal(attrs.Factory(dict))

    def __attrs_post_init__(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "config keys 'fp16.enabled' and 'bf16.enabled' are both true; enable one of them"
            )
        ours, theirs = self.gradient_accumulation_dtype, self.data_types.grad_accum_dtype
        if ours is not None and theirs is not None and ours != theirs:
            raise ConfigError(
                f"config keys 'gradient_accumulation_dtype' ({ours!r}) and "
                f"'data_types.grad_accum_dtype' ({theirs!r}) disagree; set one of them"
            )

    @property
    def dtype(self) -> "torch.dtype":
        """The training dtype: float16, bfloat16 or float32."""
        import torch

        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def grad_accum_dtype(self) -> str | None:
        """``data_types.grad_accum_dtype`` or ``gradient_accumulation_dtype``, whichever is set."""
        return self.data_types.grad_accum_dtype or self.gradient_accumulation_dtype

    def get(self, key: str, default: Any = None) -> Any:
        """The top-level ``key`` of the DeepSpeed-style dict this config was loaded from, as
        DeepSpeed's ``engine.config`` (that dict) answers ``engine.config.get(key)``; a copy, so
        the validated config cannot change under the engine."""
        import copy

        return copy.deepcopy(self.raw.get(key, default)) if self.raw else self.to_dict().get(key, default)

    def section(self, path: str) -> Any:
        """The structured plugin-owned section at the dotted ``path``: ``None`` when absent, unless
        its record is ``default_when_absent`` (then its defaults). The package that owns a section
        gives a typed accessor for it (``zkit.zero.zero_config``)."""
        return self.plugin_sections.get(path)

    def to_dict(self) -> dict:
        """Every key with its resolved value, JSON-able; ``load_config`` accepts it back."""
        out = unstructure(self)
        for path, section in sorted(self.plugin_sections.items(), key=lambda item: item[0].count(".")):
            *parents, leaf = path.split(".")
            node = out
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = unstructure(section)
        return out
