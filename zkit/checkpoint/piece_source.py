"""One checkpoint tag as zkit's pieces: what consolidation and the exports read, whatever wrote it.

A checkpoint format's ``pieces`` operation (:class:`zkit.core.records.CheckpointFormatRecord`) opens one
tag's directory as a :class:`PieceSource`; :class:`RankFiles` is zkit's own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.files import load_rank_file, rank_file, read_meta


class PieceSource(Protocol):
    """A checkpoint tag's trainable parameters as pieces (element ranges of flattened parameters)
    spread over files, plus the module's other tensors."""

    #: the tag's directory
    where: Path
    #: ``params`` (name -> shape), ``index`` (file -> ``[(name, start, end), ...]``), and when known
    #: ``state_dict_keys`` (the model's ``state_dict()`` order), ``aliases`` (tied name -> saved
    #: name), ``checksums`` with ``version`` >= 2 (zkit's), ``parts`` (a model split into parts)
    meta: dict[str, Any]
    #: the file (in ``where``) that :meth:`extras` reads
    extras_file: str

    def pieces(self, fname: str, with_state: bool = False) -> list[dict[str, Any]]:
        """The pieces ``fname`` holds: dicts with ``name``, ``start``, ``end``, ``master`` (fp32) and,
        ``with_state``, ``state`` (the optimizer's per-element tensors and scalars)."""
        ...

    def extras(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters, by name."""
        ...

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups as saved (hyperparameters), or ``[]``."""
        ...


class RankFiles:
    """A zkit checkpoint's rank files as the source of pieces; the extras are in rank 0's file."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.meta = read_meta(where)
        self.extras_file = rank_file(0)

    def pieces(self, fname: str, with_state: bool = False) -> list[dict[str, Any]]:
        data = load_rank_file(self.where / fname)
        pieces = data.get("pieces") if isinstance(data, dict) else None
        if not isinstance(pieces, list):
            raise CheckpointError(f"{self.where / fname}: checkpoint shard has no 'pieces' list")
        return pieces

    def extras(self) -> dict[str, torch.Tensor]:
        data = load_rank_file(self.where / rank_file(0))
        extras = data.get("module_extras", {}) if isinstance(data, dict) else None
        if not isinstance(extras, dict) or not all(torch.is_tensor(v) for v in extras.values()):
            raise CheckpointError(f"{self.where / rank_file(0)}: 'module_extras' is not a dict of tensors")
        return extras

    def param_groups(self) -> list[dict[str, Any]]:
        return load_rank_file(self.where / rank_file(0)).get("param_groups", [])
