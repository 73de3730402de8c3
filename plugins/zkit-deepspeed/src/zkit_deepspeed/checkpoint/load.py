"""``engine.load_checkpoint`` on a DeepSpeed checkpoint: a run trained with DeepSpeed continues in
zkit at any world size and ZeRO stage.

Each rank fills the parameter ranges it owns from the DeepSpeed ranks' files that hold them (the
same resharding as for zkit's own checkpoints); buffers and frozen parameters come from the model
file. Carried over: fp32 master weights, Adam/AdamW ``exp_avg``, ``exp_avg_sq`` and ``step``, the
optimizer's hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``), the LR scheduler, the
loss scale, the step and sample counters and the client state. The gradient clipping is the
config's, as in DeepSpeed's own resume; a config that leaves it to the default while the DeepSpeed
run clipped otherwise is refused (:mod:`.clipping`). Not carried over: random number
generator states (DeepSpeed does not save them), data sampler and curriculum state.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint import check_module_extras, check_params, fill_pieces, load_module_extras
from zkit.core.model_parts import LayerNamed, model_part
from zkit.core.verdicts import agree, agreed
from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint
from zkit_deepspeed.checkpoint.clipping import check_clipping
from zkit_deepspeed.checkpoint.open import open_checkpoint
from zkit_deepspeed.checkpoint.pipeline import DeepSpeedPipelineCheckpoint, StageView

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

log = logging.getLogger("zkit")

#: optimizer hyperparameters taken from the checkpoint (DeepSpeed restores its param groups whole)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad")


def load_deepspeed_checkpoint(
    engine: "Engine", where: Path, *, load_optimizer_states: bool, load_lr_scheduler_states: bool
) -> tuple[str, dict]:
    """Load the DeepSpeed checkpoint in ``where`` (one tag's directory) into ``engine``; return
    ``(where, client_state)`` as ``engine.load_checkpoint`` does. Every rank reads and checks what
    it loads, then the ranks agree: a checkpoint refused on one rank is refused on all, and no
    rank's state has changed (:mod:`zkit.core.verdicts`)."""
    world = engine.world_comm
    what = f"loading DeepSpeed checkpoint {where}"
    with agreed(world, what):
        ckpt = open_checkpoint(where)
        check_clipping(engine, ckpt.model_state, where)
        view = _as_held_here(engine, ckpt, where)
        check_params({"params": {n: list(s) for n, s in view.params.items()}}, engine, where)
    if isinstance(view, StageView):
        _check_all_read(engine, ckpt, view.read, where)  # the same verdict on every rank: it gathers
    with agreed(world, what):
        staged = fill_pieces(
            engine, view.index,
            lambda fname: finite_masters(view.pieces(fname, with_state=load_optimizer_states), where / fname),
            where, load_optimizer_states)
        extras = {n: t for n, t in view.module_extras().items() if n in _extra_names(engine)}
        check_module_extras(engine.module, extras, where)
        groups = view.param_groups() if load_optimizer_states else []
        loss_scaler = view.loss_scaler() if engine.loss_scaler.dynamic else engine.loss_scaler.state_dict()
        client_state = view.client_state(with_optimizer=load_optimizer_states,
                                         with_lr_scheduler=load_lr_scheduler_states)
    filled = staged.apply()
    failure: Exception | None = None
    try:
        load_module_extras(engine.module, extras, where)
        if load_optimizer_states:
            _load_hyperparameters(engine, groups)
        lr_state = ckpt.model_state.get("lr_scheduler")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and lr_state is not None:
            engine.lr_scheduler.load_state_dict(lr_state)
        steps = int(ckpt.model_state.get("global_steps", 0))
        engine.load_train_state_dict({
            "global_steps": steps,
            "global_samples": int(ckpt.model_state.get("global_samples", 0)),
            "skipped_steps": int(ckpt.model_state.get("skipped_steps", 0)),
            "micro_steps": steps * engine.gradient_accumulation_steps(),
            # a static scale stays the config's; a dynamic one continues from DeepSpeed's
            "loss_scaler": loss_scaler,
        })
    except Exception as exc:
        failure = exc
    engine.partitioner.after_load(filled)  # collectives: every rank, whatever happened above
    agree(world, what, failure)
    if engine.rank == 0:
        log.info(
            "loaded DeepSpeed checkpoint %s (ZeRO stage %d, %d ranks, DeepSpeed %s) at stage %d on %d ranks",
            where, ckpt.stage, ckpt.world_size, ckpt.model_state.get("ds_version", "?"),
            engine.partitioner.stage, engine.world_size,
        )
    return str(where), client_state


def finite_masters(pieces: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """``pieces``, refused when a master weight is NaN or infinite: a run that diverged before its
    save (DeepSpeed saves such weights as they are) must not continue silently from them."""
    for piece in pieces:
        master = piece["master"]
        if not bool(torch.isfinite(master).all()):
            bad = int((~torch.isfinite(master)).sum())
            raise CheckpointError(
                f"{path}: the fp32 master weights of {piece['name']!r} (elements {piece['start']}..{piece['end']}) "
                f"hold {bad} NaN or infinite value(s); the run diverged before this save: load an earlier checkpoint"
            )
    return pieces


def _as_held_here(
    engine: "Engine", ckpt: DeepSpeedCheckpoint | DeepSpeedPipelineCheckpoint, where: Path
) -> DeepSpeedCheckpoint | DeepSpeedPipelineCheckpoint | StageView:
    """The checkpoint under this rank's parameter names. A pipeline's loads into an unsplit model
    with its layer list's names (``nn.Sequential`` of the same layers) or, by layer name, into a
    pipeline of any stage count; an unsplit run's only into an unsplit model."""
    split = model_part(engine.module) is not None
    if isinstance(ckpt, DeepSpeedPipelineCheckpoint) and isinstance(engine.module, LayerNamed):
        return StageView(ckpt, engine.module.layer_names())
    if split and isinstance(ckpt, DeepSpeedPipelineCheckpoint):
        raise CheckpointError(
            f"{where}: a pipeline checkpoint cannot be loaded into a model split over pipeline or tensor-parallel "
            f"ranks whose parameters have no layer names ({type(engine.module).__name__} has no layer_names())"
        )
    if split:
        raise CheckpointError(
            f"{where}: a DeepSpeed checkpoint of an unsplit model loads only into an unsplit model, not into one "
            f"split over pipeline or tensor-parallel ranks ({type(engine.module).__name__}): its parameter names "
            f"say nothing of which layer each rank holds"
        )
    return ckpt


def _check_all_read(engine: "Engine", ckpt: DeepSpeedPipelineCheckpoint, read: set[str], where: Path) -> None:
    """Every parameter of the checkpoint is held by some rank (else the model has fewer layers)."""
    held = set().union(*engine.world_comm.all_gather_object(sorted(read)))
    left = [n for n in ckpt.params if n not in held]
    if left:
        raise CheckpointError(
            f"{where}: the pipeline checkpoint has parameters no stage of this model holds: {left[:5]}"
            f"{'...' if len(left) > 5 else ''} (a model with fewer layers?)"
        )


def _extra_names(engine: "Engine") -> set[str]:
    names = {n for n, _ in engine.module.named_buffers()}
    return names | {n for n, p in engine.module.named_parameters() if not p.requires_grad}


def _load_hyperparameters(engine: "Engine", saved: list[dict[str, Any]]) -> None:
    groups = engine.optimizer.param_groups
    if len(saved) == len(groups):
        pairs = list(zip(groups, saved))
    elif len({repr({k: g.get(k) for k in HYPERPARAMETERS}) for g in saved}) == 1:
        pairs = [(g, saved[0]) for g in groups]  # DeepSpeed's sub-groups of one group
    else:
        log.warning(
            "the DeepSpeed checkpoint has %d optimizer parameter groups, this engine %d: their hyperparameters "
            "come from this run's config", len(saved), len(groups),
        )
        return
    for group, values in pairs:
        for key in HYPERPARAMETERS:
            if key in values and key in group:
                group[key] = values[key]
