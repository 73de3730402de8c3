"""DeepSpeed's ``pipeline`` config section, as zkit-pipeline reads it.

In zkit a pipeline's layout is the ``PipelineModule``'s: its ``num_stages``, ``partition_method``,
``activation_checkpoint_interval`` and ``schedule`` arguments, which DeepSpeed also takes there.
DeepSpeed configs carry a ``pipeline`` section as well; it loads, and every key set to something
other than DeepSpeed's default says once, by name, where that choice is made in zkit.
"""
from __future__ import annotations

import attrs

from zkit.core.config.fields import setting


@attrs.frozen(kw_only=True)
class PipelineSectionConfig:
    """DeepSpeed's ``pipeline`` section (its keys and defaults)."""

    SECTION = "pipeline"

    stages: int | str = setting(
        "auto", doc="Number of pipeline stages.",
        hint="the number of stages is PipelineModule(num_stages=...) (or its topology's pipe degree)",
    )
    partition: str = setting(
        "best", doc="How layers are split over the stages.",
        hint="the split is PipelineModule(partition_method='parameters' | 'uniform' | 'type:REGEX')",
    )
    seed_layers: bool = setting(
        False, doc="Seed each layer's construction by its index.",
        hint="layers are built by the caller (or LayerSpec) with the RNG state they find; seed before building",
    )
    activation_checkpoint_interval: int = setting(
        0, doc="Layers per activation-checkpointed run.",
        hint="set PipelineModule(activation_checkpoint_interval=...); it checkpoints through zkit.activations.recompute",
    )
    pipe_partitioned: bool = setting(
        True, doc="Split activations sent between stages over the tensor-parallel ranks.",
        hint="zkit sends each stage boundary's activations whole between corresponding tensor-parallel ranks",
    )
    grad_partitioned: bool = setting(
        True, doc="Split gradients sent between stages over the tensor-parallel ranks.",
        hint="zkit sends each stage boundary's gradients whole between corresponding tensor-parallel ranks",
    )
    use_reentrant: bool = setting(
        True, doc="Reentrant activation checkpointing.",
        hint="the pipeline's activation checkpointing runs non-reentrant (zkit.activations.recompute)",
    )
