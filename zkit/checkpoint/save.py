"""Writing a checkpoint: every rank its pieces, rank 0 the metadata, atomically (a split model:
every part's ranks their part, see :mod:`zkit.checkpoint.parts`)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.checkpoint import rng
from zkit.checkpoint.accumulation import refuse_partial_accumulation
from zkit.checkpoint.config import checkpoint_config
from zkit.checkpoint.digest import payload_digests
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.files import FORMAT, META, VERSION, atomic_torch_save, atomic_write_bytes, rank_file, write_meta
from zkit.checkpoint.tags import LATEST
from zkit.checkpoint.parts import model_part

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
    refuse_partial_accumulation(engine)  # before anything is written
    comm, rank = engine.comm, engine.rank
    world = getattr(engine, "world_comm", comm)
    part = model_part(engine.module)
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.')")
    tag = _validate_tag(tag, world, checkpoint_config(engine.config).tag_validation)
    root = Path(save_dir)
    final, staging = root / tag, root / f".{tag}.partial"
    if world.rank == 0:
        _check_client_state(client_state)
        root.mkdir(parents=True, exist_ok=True)
        # Staging left by a save that died (any tag): never a checkpoint, only disk space lost.
        for stale in root.glob(".*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir()
    world.barrier()
    # a split model: each part's data-parallel group writes its own directory
    target = staging / part[0] if part is not None else staging
    if part is not None and rank == 0:
        target.mkdir()
    comm.barrier()

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
        "rng": rng.capture(),
        "plugins": engine.pm.call_each_named("zkit_checkpoint_save", engine=engine),
    }
    if rank == 0:
        payload["client_state"] = client_state
        payload["module_extras"] = module_extras(engine.module, exclude_frozen_parameters)
        payload["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ]
        if engine.lr_scheduler is not None:
            payload["lr_scheduler"] = engine.lr_scheduler.state_dict()
    digests = payload_digests(payload)
    failure = None
    try:
        atomic_torch_save(payload, target / rank_file(rank))
    except CheckpointError as exc:
        failure = f"rank {world.rank}: {exc}"  # every rank learns it below, rather than wait for this file
    gathered = comm.all_gather_object(([[p.name, p.start, p.end] for p in pieces], digests, failure))
    failures = [f for _, _, f in gathered if f]
    if rank == 0 and not failures:
        meta = _meta(engine, tag, [entries for entries, _, _ in gathered], exclude_frozen_parameters)
        meta["checksums"] = {rank_file(r): d for r, (_, d, _) in enumerate(gathered)}
        if part is not None:
            meta["part"], meta["layout"] = part
        write_meta(target / META, meta)
    if part is not None:
        parts = world.all_gather_object((part[0], failures))  # also the barrier: every part is on disk
        failures = sorted({f for _, fs in parts for f in fs})
    if failures:
        raise CheckpointError(f"saving checkpoint {tag!r} failed; {'; '.join(failures)}")
    if part is not None and world.rank == 0:
        write_meta(staging / META, {
            "format": FORMAT, "version": VERSION, "tag": tag, "layout": part[1],
            "parts": sorted({name for name, _ in parts}), "global_steps": engine.global_steps,
        })
    if world.rank == 0:
        old = root / f".{tag}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            atomic_write_bytes(root / LATEST, tag.encode())
    world.barrier()
    return str(final)


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
