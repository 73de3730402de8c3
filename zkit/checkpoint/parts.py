"""Checkpoints of models split over model-parallel ranks (pipeline stages, tensor slices).

A model that is split exposes ``model_parallel_part`` (:mod:`zkit.core.model_parts`: the name
of the part this rank holds and the layout of all parts). The ranks holding one part
are that part's data-parallel group (``engine.comm``); they write the part as an ordinary sharded
checkpoint in ``<tag>/<name>/`` (rank files, the part's own metadata), so loading reshards within a
part exactly as for an unsplit model: a different data-parallel degree loads. The tag's own
``meta.msgpack`` lists the parts and the layout; it is written, the staging directory renamed and
``latest`` updated by global rank 0 after every part is on disk (barriers over the whole world,
``engine.world_comm``). A different layout (another stage count, another layer split) is refused
with the difference named.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from zkit.core.checkpoint_errors import CheckpointError


def check_layout(where: Path, saved: dict[str, Any], ours: dict[str, Any]) -> None:
    """Refuse a checkpoint whose parts were cut differently from this model's."""
    if _plain(saved) == _plain(ours):
        return
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, model {ours.get(key)!r}"
        for key in sorted(set(saved) | set(ours))
        if _plain(saved.get(key)) != _plain(ours.get(key))
    ]
    hint = ""
    if _plain(saved.get("pipe")) != _plain(ours.get("pipe")):
        hint = (
            f"; loading across pipeline stage counts ({saved.get('pipe')} -> {ours.get('pipe')}) is not supported: "
            f"load with {saved.get('pipe')} stages (a different data-parallel degree is fine)"
        )
    raise CheckpointError(
        f"{where}: the checkpoint was written by a model split differently from this one ({'; '.join(diffs)}){hint}"
    )


def refuse_mismatch(where: Path, saved_parts: list[str] | None, ours: tuple[str, dict[str, Any]] | None) -> None:
    """A split checkpoint needs a split model and the other way round."""
    if saved_parts is not None and ours is None:
        raise CheckpointError(
            f"{where}: the checkpoint holds a model split into {len(saved_parts)} model-parallel parts "
            f"({', '.join(saved_parts)}); this model is not split: load it into the same pipeline/tensor layout"
        )
    if saved_parts is None and ours is not None:
        raise CheckpointError(
            f"{where}: the checkpoint holds an unsplit model; this model is split into model-parallel parts "
            f"(this rank holds {ours[0]!r}): load it into an unsplit model"
        )


def _plain(value: Any) -> Any:
    """msgpack gives lists where the model has tuples."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
