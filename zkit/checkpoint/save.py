"""Writing a checkpoint: every rank its pieces, rank 0 the metadata, atomically (a split model:
every part's ranks their part, see :mod:`zkit.checkpoint.parts`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.checkpoint import rng_state
from zkit.checkpoint.accumulation import refuse_partial_accumulation
from zkit.checkpoint.config import checkpoint_config
from zkit.checkpoint.digest import payload_digests
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.commit import commit, prepare, staging_directory
from zkit.checkpoint.files import FORMAT, META, VERSION, atomic_torch_save, rank_file, write_meta
from zkit.core.model_parts import model_part
from zkit.core.verdicts import agree, agreed

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

log = logging.getLogger("zkit")


def _piece_state(engine: "Engine", opt_param: torch.Tensor) -> dict[str, Any]:
    state = engine.optimizer.state.get(opt_param, {})
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state.items()}


def module_extras(module: torch.nn.Module, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """State the partitioner does not own: buffers and (unless excluded) frozen parameters."""
    out = {name: b.detach().cpu().clone() for name, b in module.named_buffers()}
    if not exclude_frozen_parameters:
        out.update(
            {name: p.detach().cpu().clone() for name, p in module.named_parameters() if not p.requires_grad}
        )
    return out


def _frozen_names(module: torch.nn.Module) -> set[str]:
    """Every name (tied aliases too) under which a frozen parameter is reachable."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def tensor_aliases(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for every parameter or buffer reachable under more than one name (tied
    weights); the canonical name is the first, the one the checkpoint stores the tensor under."""
    aliases: dict[str, str] = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        first: dict[int, str] = {}
        for name, tensor in named:
            canonical = first.setdefault(id(tensor), name)
            if canonical != name:
                aliases[name] = canonical
    return aliases


def _check_client_state(client_state: dict) -> None:
    import io

    buf = io.BytesIO()
    torch.save(client_state, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            "client_state must hold only tensors, numbers, strings, lists, tuples and dicts (checkpoints are "
            f"loaded with weights_only=True); it does not: {exc}"
        ) from exc


def _validate_tag(tag: str, world: Any, mode: str) -> str:
    """``checkpoint.tag_validation``: the ranks of one checkpoint must agree on its tag. FAIL
    refuses before anything is written; WARN says so and saves under rank 0's tag (ranks writing
    under different tags would leave two half checkpoints); IGNORE does not compare (one
    collective less per save)."""
    if mode == "IGNORE" or world.world_size == 1:
        return tag
    tags = world.all_gather_object(tag)
    if len(set(tags)) == 1:
        return tag
    listed = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "FAIL":
        raise CheckpointError(f"ranks save under different checkpoint tags ({listed}); checkpoint.tag_validation is FAIL")
    if world.rank == 0:
        log.warning(
            "ranks save under different checkpoint tags (%s); saving under rank 0's tag %r (set "
            "checkpoint.tag_validation to FAIL to stop instead)", listed, tags[0],
        )
    return tags[0]


def save_checkpoint(engine: "Engine", save_dir: str, *, tag: str | None, client_state: dict, save_latest: bool,
                    exclude_frozen_parameters: bool = False) -> str:
    """Every rank writes its file, the first rank the metadata and the commit
    (:mod:`zkit.checkpoint.commit`). Each step that can fail on some ranks only (a refusal, a
    file-system error on the first rank, a failed write) is agreed on: every rank raises
    (:mod:`zkit.core.verdicts`), none waits for the others in a collective."""
    comm, rank = engine.comm, engine.rank
    world = getattr(engine, "world_comm", comm)
    tag = tag or f"global_step{engine.global_steps}"
    with agreed(world, f"saving checkpoint {tag!r}"):  # refusals, before anything is written
        refuse_partial_accumulation(engine)
        part = model_part(engine.module)
        if "/" in tag or tag.startswith("."):
            raise CheckpointError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.')")
        if world.rank == 0:
            _check_client_state(client_state)
    tag = _validate_tag(tag, world, checkpoint_config(engine.config).tag_validation)
    what = f"saving checkpoint {tag!r}"
    root = Path(save_dir)
    staging = staging_directory(root, tag)
    parts = sorted(set(world.all_gather_object(part[0]))) if part is not None else None
    with agreed(world, what):
        if world.rank == 0:
            prepare(root, tag)
    # a split model: each part's data-parallel group writes its own directory
    target = staging / part[0] if part is not None else staging
    if part is not None:
        with agreed(world, what):
            if rank == 0:
                target.mkdir()

    failure: Exception | None = None
    entries: list[list[Any]] = []
    digests: dict[str, str] = {}
    try:
        payload, entries = _payload(engine, client_state, exclude_frozen_parameters)
        digests = payload_digests(payload)
        atomic_torch_save(payload, target / rank_file(rank))
    except Exception as exc:
        failure = exc  # every rank learns it below, rather than wait for this file
    gathered = comm.all_gather_object((entries, digests, failure is None))
    if rank == 0 and all(ok for _, _, ok in gathered):
        try:
            meta = _meta(engine, tag, [e for e, _, _ in gathered], exclude_frozen_parameters)
            meta["checksums"] = {rank_file(r): d for r, (_, d, _) in enumerate(gathered)}
            if part is not None:
                meta["part"], meta["layout"] = part
            write_meta(target / META, meta)
        except Exception as exc:
            failure = exc
    agree(world, what, failure)  # every part is on disk, or every rank raises
    with agreed(world, what):
        if world.rank == 0:
            if part is not None:
                write_meta(staging / META, {
                    "format": FORMAT, "version": VERSION, "tag": tag, "layout": part[1], "parts": parts,
                    "global_steps": engine.global_steps,
                })
            commit(root, tag, save_latest)
    return str(root / tag)


def _payload(engine: "Engine", client_state: dict, exclude_frozen_parameters: bool) -> tuple[dict[str, Any], list[Any]]:
    """This rank's file: its pieces (and on rank 0 what the whole model shares); and the
    ``(name, start, end)`` of each piece, for the metadata's index."""
    part_obj = engine.partitioner
    pieces = part_obj.pieces() if part_obj.writes_checkpoint() else []
    payload: dict[str, Any] = {
        "pieces": [
            {
                "name": p.name,
                "start": p.start,
                "end": p.end,
                "master": p.master.detach().float().cpu().clone(),
                "state": _piece_state(engine, p.opt_param),
            }
            for p in pieces
        ],
        "rng": rng_state.capture(),
        "plugins": engine.pm.call_each_named("zkit_checkpoint_save", engine=engine),
    }
    if engine.rank == 0:
        payload["client_state"] = client_state
        payload["module_extras"] = module_extras(engine.module, exclude_frozen_parameters)
        payload["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ]
        if engine.lr_scheduler is not None:
            payload["lr_scheduler"] = engine.lr_scheduler.state_dict()
    return payload, [[p.name, p.start, p.end] for p in pieces]


def _meta(engine: "Engine", tag: str, index: list[Any], exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    part = engine.partitioner
    left_out = _frozen_names(engine.module) if exclude_frozen_parameters else set()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": part.stage,
        "partitioner": engine.records["partitioner"].name,
        "optimizer": part.ctx.optimizer.name,
        "optimizer_state_format": part.ctx.optimizer.saved_state_format,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "params": {name: list(p.shape) for name, p in part.named_trainable()},
        "index": {rank_file(r): entries for r, entries in enumerate(index)},
        # What a consolidated state dict needs beyond the pieces and module extras: every key
        # model.state_dict() has (persistent buffers only) and the tied names among them.
        "state_dict_keys": [k for k in engine.module.state_dict(keep_vars=True) if k not in left_out],
        "aliases": {k: v for k, v in tensor_aliases(engine.module).items() if k not in left_out},
    }
    # which names are frozen parameters (a consolidation may leave them out), and whether they were saved
    meta["frozen_parameters"] = sorted(_frozen_names(engine.module))
    meta["frozen_parameters_saved"] = not exclude_frozen_parameters
    return meta
