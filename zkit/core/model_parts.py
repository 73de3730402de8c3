"""The split-model protocol: how a model split over model-parallel ranks (pipeline stages, tensor
slices) says which part a rank holds, read by every package that must treat a split model apart
(checkpoints write one sharded checkpoint per part, ``zkit.zero.Init`` refuses a pipeline it
cannot gather, the drop-in loads DeepSpeed's pipeline checkpoints by layer name).

A model that is split exposes ``model_parallel_part``: ``(name, layout)``, the name of the part
this rank holds (``"pipe01"``, ``"pipe00-tensor01"``) and the layout of all parts (a dict the same
on every rank, e.g. ``{"pipe": 2, "tensor": 1, "layer_bounds": [...]}``). zkit-pipeline's
``PipelineModule`` is such a model.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from zkit.core.checkpoint_errors import CheckpointError


@runtime_checkable
class LayerNamed(Protocol):
    """A split model whose parameters have names that do not depend on the split (a pipeline's
    ``<layer index>.<name>``), so that a checkpoint of another split loads by name."""

    def layer_names(self) -> dict[str, str]:
        """``{name in this module: name in the whole model}`` of every parameter and buffer held here."""
        ...


def model_part(module: Any) -> tuple[str, dict[str, Any]] | None:
    """``(name, layout)`` of the part of a split model this rank holds, or None."""
    part = getattr(module, "model_parallel_part", None)
    if part is None:
        return None
    name, layout = part
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"model_parallel_part name {name!r} must be a plain directory name")
    if not isinstance(layout, dict):
        raise CheckpointError(f"model_parallel_part layout must be a dict, got {type(layout).__name__}")
    return name, layout


def pipeline_under_init_refusal(stages: int) -> str:
    """Why a model of ``stages`` pipeline stages cannot be built under ``zkit.zero.Init``: ZeRO's
    Init refuses such a model with it, and zkit-pipeline a ``PipelineModule`` built inside Init."""
    return (f"zkit.zero.Init cannot build a model for pipeline parallelism ({stages} pipeline stages): Init "
            f"partitions each layer over all ranks, and each stage keeps only its own layers, so they cannot be "
            f"gathered back. Build the PipelineModule without zkit.zero.Init: each rank holds only its stage's "
            f"layers (give them as LayerSpec, so that no rank builds another stage's); the pipeline runs ZeRO "
            f"stages below 3, which hold whole parameters anyway")
