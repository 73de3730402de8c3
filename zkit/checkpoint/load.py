"""Loading a checkpoint at any world size and stage: each rank fills the pieces it owns now from
the overlapping saved pieces, wherever they are (a split model: within its own part's directory,
at any data-parallel degree)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.checkpoint import rng_state
from zkit.checkpoint.commit import loadable_directory
from zkit.checkpoint.digest import VerifiedCopies
from zkit.checkpoint.fill import StagedPieces, fill_pieces
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.files import META, file_digests, load_rank_file, rank_file, read_meta
from zkit.checkpoint.tags import resolve_tag
from zkit.checkpoint.parts import check_layout, refuse_mismatch
from zkit.core.model_parts import model_part
from zkit.core.verdicts import agree, agreed

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine


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


class _Staged:
    """A checkpoint read and verified for this rank, nothing of the engine changed yet."""

    def __init__(self, directory: Path, where: Path, meta: dict[str, Any], pieces: StagedPieces, first: dict,
                 mine: dict | None) -> None:
        self.directory = directory  # the tag's directory (or the one an interrupted overwrite set aside)
        self.where = where  # where the files are: the directory, or this rank's part of it
        self.meta = meta
        self.pieces = pieces
        self.first = first  # rank 0's file
        self.mine = mine  # this rank's file when it saved at this world size


def _stage(engine: "Engine", root: Path, tag: str | None, load_optimizer_states: bool) -> _Staged:
    """Read, check and verify everything this rank loads from ``root`` (``tag``, else ``latest``'s)."""
    directory = where = loadable_directory(root, resolve_tag(root, tag))
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

    def pieces_of(fname: str) -> list[dict[str, Any]]:
        pieces = read(fname)["pieces"]
        held = sorted((p["name"], p["start"], p["end"]) for p in pieces)
        if held != sorted((name, start, end) for name, start, end in meta["index"][fname]):
            raise CheckpointError(
                f"{where / fname}: holds other pieces than {META} lists for it (a rank file swapped with another or "
                f"copied from another save?); restore the checkpoint's own files or load another checkpoint"
            )
        return pieces

    staged = fill_pieces(engine, meta["index"], pieces_of, where, load_optimizer_states, verified.copy)
    first = read(rank_file(0))
    mine = first if engine.rank == 0 else None
    if meta["world_size"] == engine.world_size and engine.rank != 0:
        mine = read(rank_file(engine.rank))
    verified.finish()
    check_module_extras(engine.module, first.get("module_extras", {}), where)
    return _Staged(directory, where, meta, staged, first, mine)


def load_checkpoint(
    engine: "Engine",
    load_dir: str | Path,
    tag: str | None = None,
    *,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> tuple[str, dict]:
    """The ``"zkit"`` checkpoint format's ``load``: ``load_dir/tag`` (``tag`` from ``latest`` when
    None) into ``engine``; returns ``(load_dir/tag, client_state)``. Every rank reads and verifies
    what it loads, then the ranks agree: a checkpoint refused on any rank is refused on all, and
    no rank's state has changed (:mod:`zkit.core.verdicts`). What can fail only after that (an LR
    scheduler or a plugin refusing its saved state) is agreed on too, with the state partly loaded."""
    root = Path(load_dir)
    world = getattr(engine, "world_comm", engine.comm)
    what = f"loading checkpoint {root if tag is None else root / tag}"
    with agreed(world, what):
        staged = _stage(engine, root, tag, load_optimizer_states)
    first, mine = staged.first, staged.mine
    failure: Exception | None = None
    filled = staged.pieces.apply()
    try:
        load_module_extras(engine.module, first.get("module_extras", {}), staged.where)
        if load_optimizer_states:
            saved_groups = first.get("param_groups", [])
            if len(saved_groups) == len(engine.optimizer.param_groups):
                for group, saved in zip(engine.optimizer.param_groups, saved_groups):
                    group.update(saved)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and "lr_scheduler" in first:
            engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
        if mine is not None:
            rng_state.restore(mine["rng"])  # same world size: training continues bit for bit
        engine.load_train_state_dict(staged.meta)  # the counters and the loss scaler
        plugin_state = (mine or first).get("plugins", {})
        engine.pm.call_each_with("zkit_checkpoint_load", plugin_state, engine=engine)
    except Exception as exc:
        failure = exc
    engine.partitioner.after_load(filled)  # collectives: every rank, whatever happened above
    agree(world, what, failure)
    return str(staged.directory), first.get("client_state", {})


def check_module_extras(module: torch.nn.Module, extras: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse saved buffers or frozen parameters ``module`` lacks (before anything is loaded)."""
    targets = _extra_targets(module)
    for name in extras:
        if name not in targets:
            raise CheckpointError(f"{where}: buffer {name!r} is in the checkpoint but not in the model")


def _extra_targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    targets = dict(module.named_buffers())
    targets.update({n: p for n, p in module.named_parameters() if not p.requires_grad})
    return targets


def load_module_extras(module: torch.nn.Module, extras: dict[str, torch.Tensor], where: Path) -> None:
    """Copy saved buffers and frozen parameters into ``module``; a name it lacks is refused."""
    check_module_extras(module, extras, where)
    targets = _extra_targets(module)
    for name, value in extras.items():
        with torch.no_grad():
            targets[name].copy_(value)
