"""Loading a checkpoint at any world size and stage: each rank fills the pieces it owns now from
the overlapping saved pieces, wherever they are (a split model: within its own part's directory,
at any data-parallel degree)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from zkit.checkpoint import rng
from zkit.checkpoint.digest import VerifiedCopies
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.files import file_digests, load_rank_file, rank_file, read_meta
from zkit.checkpoint.tags import resolve_tag
from zkit.checkpoint.optim_state import StatePlacer
from zkit.checkpoint.parts import check_layout, model_part, refuse_mismatch

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine
    from zkit.core.partitioner import Piece


def check_params(meta: dict[str, Any], engine: "Engine", where: Path) -> None:
    """Refuse a checkpoint whose ``meta["params"]`` (name -> shape) differs from the engine's
    trainable parameters, naming the differences."""
    saved = meta["params"]
    model = {name: list(p.shape) for name, p in engine.partitioner.named_trainable()}
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the checkpoint's parameters do not match the model: missing from the checkpoint "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, not in the model "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in model.items():
        if list(saved[name]) != shape:
            raise CheckpointError(
                f"{where}: parameter {name!r} has shape {tuple(shape)} in the model but "
                f"{tuple(saved[name])} in the checkpoint"
            )


def _check_state_format(meta: dict[str, Any], engine: "Engine", where: Path) -> None:
    """Refuse optimizer state saved by an optimizer whose state means something else (1-bit
    Adam's frozen variance read as AdamW's second moment would move weights by orders of
    magnitude). Checkpoints written before the format was recorded are not checked."""
    saved = meta.get("optimizer_state_format")
    if engine.inference_only:
        return  # no optimizer to load into
    record = engine.partitioner.ctx.optimizer
    if saved is None or saved == record.saved_state_format:
        return
    raise CheckpointError(
        f"{where}: the optimizer state was saved by optimizer {meta.get('optimizer')!r} (state format {saved!r}) "
        f"and cannot be loaded into optimizer {record.name!r} (state format {record.saved_state_format!r}): the "
        f"saved tensors mean something else there. Load with load_optimizer_states=False to take the weights "
        f"(and restart the optimizer's state), or resume with {meta.get('optimizer')!r}"
    )


Copy = Callable[[torch.Tensor, torch.Tensor], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class _Filler:
    """Copies saved ranges into one owned piece and checks the piece ends up fully covered."""

    def __init__(self, piece: "Piece", engine: "Engine", with_state: bool, copy: Copy,
                 placer: StatePlacer | None) -> None:
        self.piece = piece
        self.covered = 0
        self.with_state = with_state
        self.state: dict[str, Any] = {}
        self.optimizer = engine.optimizer
        self.placer = placer
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
        self.copy(p.master.view(-1)[dst], master if whole else master[src])
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

    def finish(self) -> None:
        p = self.piece
        if self.covered != p.end - p.start:
            raise CheckpointError(
                f"the checkpoint covers {self.covered} of the {p.end - p.start} elements "
                f"[{p.start}, {p.end}) of parameter {p.name!r}"
            )
        if self.with_state and self.state:
            self.optimizer.state[p.opt_param] = self.placer.place(p.opt_param, self.state)


def fill_pieces(
    engine: "Engine",
    index: dict[str, list[Any]],
    read: Callable[[str], list[dict[str, Any]]],
    where: Path,
    with_state: bool,
    copy: Copy = _copy,
) -> list["Piece"]:
    """Fill every piece this rank owns (its fp32 master values and, ``with_state``, its
    optimizer state) from saved pieces. ``index`` maps each file to the ``(name, start, end)``
    ranges it holds; ``read(file)`` returns the file's saved pieces (dicts with ``name``,
    ``start``, ``end``, ``master`` and ``state``). Only files holding ranges this rank owns are
    read; a piece left partly uncovered is an error. ``copy(dst, src)`` makes every copy (given a
    saved tensor itself when the whole of it is copied). Returns the filled pieces, for
    ``partitioner.after_load``."""
    pieces = engine.partitioner.pieces()
    fillers: dict[str, list[_Filler]] = {}
    placer = StatePlacer(engine.optimizer) if with_state else None
    for piece in pieces:
        fillers.setdefault(piece.name, []).append(_Filler(piece, engine, with_state, copy, placer))
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
    for group in fillers.values():
        for f in group:
            f.finish()
    return pieces


def load_checkpoint(
    engine: "Engine",
    load_dir: str | Path,
    tag: str | None = None,
    *,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> tuple[str, dict]:
    """The ``"zkit"`` checkpoint format's ``load``: ``load_dir/tag`` (``tag`` from ``latest`` when
    None) into ``engine``; returns ``(load_dir/tag, client_state)``."""
    root = Path(load_dir)
    tag = resolve_tag(root, tag)
    where = root / tag
    meta = read_meta(where)
    part = model_part(engine.module)
    refuse_mismatch(where, meta.get("parts"), part)
    if part is not None:
        check_layout(where, meta["layout"], part[1])
        if part[0] not in meta["parts"]:
            raise CheckpointError(f"{where}: no part {part[0]!r} in the checkpoint (it has {', '.join(meta['parts'])})")
        where = where / part[0]
        meta = read_meta(where)
    check_params(meta, engine, where)
    if load_optimizer_states:
        _check_state_format(meta, engine, where)

    # Read each file once: rank 0's and this rank's are kept for what follows. Each tensor is
    # verified as it is copied out whole (in the copy's pass), the rest before anything else is used.
    kept: dict[str, dict] = {}
    verified = VerifiedCopies()

    def read(fname: str) -> dict:
        data = kept.get(fname)
        if data is None:
            data = load_rank_file(where / fname)
            digests = file_digests(meta, fname, where)
            if digests is not None:
                verified.add(data, digests, where / fname)
        if fname in (rank_file(0), rank_file(engine.rank)):
            kept[fname] = data
        return data

    filled = fill_pieces(engine, meta["index"], lambda fname: read(fname)["pieces"], where, load_optimizer_states,
                         verified.copy)

    first = read(rank_file(0))
    mine = first if engine.rank == 0 else None
    if meta["world_size"] == engine.world_size and engine.rank != 0:
        mine = read(rank_file(engine.rank))
    verified.finish()
    load_module_extras(engine.module, first.get("module_extras", {}), where)
    if load_optimizer_states:
        saved_groups = first.get("param_groups", [])
        if len(saved_groups) == len(engine.optimizer.param_groups):
            for group, saved in zip(engine.optimizer.param_groups, saved_groups):
                group.update(saved)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and "lr_scheduler" in first:
        engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
    if mine is not None:
        rng.restore(mine["rng"])  # same world size: training continues bit for bit
    engine.load_train_state_dict(meta)  # the counters and the loss scaler
    plugin_state = (mine or first).get("plugins", {})
    engine.pm.call_each_with("zkit_checkpoint_load", plugin_state, engine=engine)
    engine.partitioner.after_load(filled)
    getattr(engine, "world_comm", engine.comm).barrier()
    return str(root / tag), first.get("client_state", {})


def load_module_extras(module: torch.nn.Module, extras: dict[str, torch.Tensor], where: Path) -> None:
    """Copy saved buffers and frozen parameters into ``module``; a name it lacks is refused."""
    targets = dict(module.named_buffers())
    targets.update({n: p for n, p in module.named_parameters() if not p.requires_grad})
    for name, value in extras.items():
        if name not in targets:
            raise CheckpointError(f"{where}: buffer {name!r} is in the checkpoint but not in the model")
        with torch.no_grad():
            targets[name].copy_(value)
