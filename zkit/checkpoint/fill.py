"""Filling the pieces a rank owns from saved pieces, in two steps: :func:`fill_pieces` copies the
saved ranges into buffers of its own and checks every piece is covered, changing nothing of the
engine; :meth:`StagedPieces.apply` then copies them into the pieces. A loader agrees with the other
ranks in between (:mod:`zkit.core.verdicts`), so a checkpoint refused on one rank leaves every
rank's state as it was. zkit's own checkpoints and the DeepSpeed drop-in's both load through here."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from zkit.checkpoint.optim_state import StatePlacer
from zkit.core.checkpoint_errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine
    from zkit.core.partitioner import Piece

Copy = Callable[[torch.Tensor, torch.Tensor], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class _Filler:
    """Copies saved ranges into a buffer shaped like one owned piece, and its optimizer state."""

    def __init__(self, piece: "Piece", with_state: bool, copy: Copy) -> None:
        self.piece = piece
        # on the host: a load stages as much as the rank's share of the checkpoint
        self.master = torch.empty(piece.end - piece.start, dtype=piece.master.dtype, device="cpu")
        self.covered = 0
        self.with_state = with_state
        self.state: dict[str, Any] = {}
        self.copy = copy

    def fill(self, saved: dict[str, Any], where: Path) -> None:
        p = self.piece
        lo, hi = max(p.start, saved["start"]), min(p.end, saved["end"])
        if lo >= hi:
            return
        src = slice(lo - saved["start"], hi - saved["start"])
        dst = slice(lo - p.start, hi - p.start)
        whole = lo == saved["start"] and hi == saved["end"]  # a saved tensor itself, not a slice of it
        master = saved["master"]
        if master.numel() != saved["end"] - saved["start"]:
            raise CheckpointError(f"{where}: piece {p.name}[{saved['start']}:{saved['end']}] is truncated")
        self.copy(self.master[dst], master if whole else master[src])
        self.covered += hi - lo
        if not self.with_state:
            return
        n = saved["end"] - saved["start"]
        for key, value in saved["state"].items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == n:
                if key not in self.state:
                    self.state[key] = torch.zeros(p.end - p.start, dtype=value.dtype, device="cpu")
                self.copy(self.state[key][dst], value if whole else value[src])
            else:
                self.state.setdefault(key, value.clone() if torch.is_tensor(value) else value)

    def check(self, index: dict[str, list[Any]], where: Path) -> None:
        p = self.piece
        if self.covered == p.end - p.start:
            return
        listed = [f for f, entries in index.items() if any(n == p.name and s < p.end and p.start < e for n, s, e in entries)]
        found = f"its metadata lists them in {', '.join(listed)}" if listed else "no file of it lists them"
        raise CheckpointError(
            f"{where}: the checkpoint covers {self.covered} of the {p.end - p.start} elements [{p.start}, {p.end}) "
            f"of parameter {p.name!r}; {found}"
        )

    def apply(self, optimizer: torch.optim.Optimizer, placer: StatePlacer | None) -> None:
        p = self.piece
        p.master.view(-1).copy_(self.master)
        if self.with_state and self.state:
            optimizer.state[p.opt_param] = placer.place(p.opt_param, self.state)


class StagedPieces:
    """Every piece a rank owns, filled and checked but not yet copied into the engine."""

    def __init__(self, engine: "Engine", pieces: list["Piece"], fillers: list[_Filler], with_state: bool) -> None:
        self.engine = engine
        self.pieces = pieces
        self.fillers = fillers
        self.with_state = with_state

    def apply(self) -> list["Piece"]:
        """Copy the staged values into the pieces (and their optimizer state); return the pieces,
        for ``partitioner.after_load``."""
        optimizer = self.engine.optimizer
        placer = StatePlacer(optimizer) if self.with_state else None
        for f in self.fillers:
            f.apply(optimizer, placer)
        return self.pieces


def fill_pieces(
    engine: "Engine",
    index: dict[str, list[Any]],
    read: Callable[[str], list[dict[str, Any]]],
    where: Path,
    with_state: bool,
    copy: Copy = _copy,
) -> StagedPieces:
    """Stage every piece this rank owns (its fp32 master values and, ``with_state``, its
    optimizer state) from saved pieces. ``index`` maps each file to the ``(name, start, end)``
    ranges it holds; ``read(file)`` returns the file's saved pieces (dicts with ``name``,
    ``start``, ``end``, ``master`` and ``state``). Only files holding ranges this rank owns are
    read; a piece left partly uncovered is an error naming the files the index lists for it.
    ``copy(dst, src)`` makes every copy (given a saved tensor itself when the whole of it is
    copied). Nothing of the engine changes until :meth:`StagedPieces.apply`."""
    pieces = engine.partitioner.pieces()
    fillers: dict[str, list[_Filler]] = {}
    for piece in pieces:
        fillers.setdefault(piece.name, []).append(_Filler(piece, with_state, copy))
    for fname, entries in index.items():
        if not any(
            f.piece.start < end and start < f.piece.end
            for name, start, end in entries
            for f in fillers.get(name, ())
        ):
            continue
        for saved in read(fname):
            for f in fillers.get(saved["name"], ()):
                f.fill(saved, where / fname)
    staged = [f for group in fillers.values() for f in group]
    for f in staged:
        f.check(index, where)
    return StagedPieces(engine, pieces, staged, with_state)
