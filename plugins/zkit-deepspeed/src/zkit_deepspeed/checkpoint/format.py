"""The ``"deepspeed"`` checkpoint format (:class:`zkit.core.records.CheckpointFormatRecord`): zkit
recognises a DeepSpeed checkpoint directory (``latest`` naming ``global_step*/`` with
``mp_rank_*_model_states.pt`` and ZeRO ``*_optim_states.pt`` files) and loads it into an engine
(:mod:`~zkit_deepspeed.checkpoint.load`) or reads its pieces for ``zkit consolidate`` and the
exports (:class:`DeepSpeedFiles`). It writes no DeepSpeed checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.checkpoint import META, tag_directory
from zkit.core.records import CheckpointFormatRecord
from zkit_deepspeed.checkpoint.layout import looks_like_deepspeed
from zkit_deepspeed.checkpoint.load import load_deepspeed_checkpoint
from zkit_deepspeed.checkpoint.open import open_checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine


def is_deepspeed(path: Path, tag: str | None) -> bool:
    """Whether the tag directory ``load_checkpoint(path, tag)`` reads holds DeepSpeed's files (and
    is not a zkit checkpoint)."""
    where = tag_directory(path, tag)
    return where is not None and not (where / META).is_file() and looks_like_deepspeed(where)


def load(engine: "Engine", path: Path, tag: str | None, *, load_optimizer_states: bool,
         load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any]]:
    return load_deepspeed_checkpoint(engine, tag_directory(path, tag), load_optimizer_states=load_optimizer_states,
                                     load_lr_scheduler_states=load_lr_scheduler_states)


class DeepSpeedFiles:
    """A DeepSpeed checkpoint tag as a :class:`zkit.checkpoint.piece_source.PieceSource`: its
    optimizer files hold the pieces (fp32 masters and optimizer state), its model file the extras
    (buffers, frozen parameters)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.ckpt = open_checkpoint(where)
        files = self.ckpt.layout.layer_files or self.ckpt.layout.model_files
        self.extras_file = files[0].name
        self.meta = {
            "params": {n: list(shape) for n, shape in self.ckpt.params.items()},
            "index": self.ckpt.index,
            "state_dict_keys": self.ckpt.state_dict_keys(),
            "aliases": self.ckpt.aliases,
        }

    def pieces(self, fname: str, with_state: bool = False) -> list[dict[str, Any]]:
        return self.ckpt.pieces(fname, with_state=with_state)

    def extras(self) -> dict[str, torch.Tensor]:
        return self.ckpt.module_extras()

    def param_groups(self) -> list[dict[str, Any]]:
        return self.ckpt.param_groups()


RECORD = CheckpointFormatRecord(
    name="deepspeed", detect=is_deepspeed, load=load, pieces=DeepSpeedFiles,
    description="DeepSpeed's ZeRO 0-3 and pipeline checkpoints (read: continue at any world size and stage)",
)
