"""The DeepSpeed checkpoint in one tag's directory, as the class that reads its layout: a pipeline's
(one file per layer and per stage) or an unsplit model's."""
from __future__ import annotations

from pathlib import Path

from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint
from zkit_deepspeed.checkpoint.layout import detect
from zkit_deepspeed.checkpoint.pipeline import DeepSpeedPipelineCheckpoint


def open_checkpoint(where: Path) -> DeepSpeedCheckpoint | DeepSpeedPipelineCheckpoint:
    """The DeepSpeed checkpoint in ``where`` (one tag's directory), a pipeline's or not."""
    layout = detect(where)
    if layout.layer_files:
        return DeepSpeedPipelineCheckpoint(where, layout)
    return DeepSpeedCheckpoint(where)
