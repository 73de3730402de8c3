"""``engine.save_16bit_model``: the model's weights in its training dtype as one ``state_dict``
file, the way DeepSpeed writes ``pytorch_model.bin`` for serving or a Hugging Face upload.

At stage 3 the weights are partitioned: they are gathered module by module (never the whole model
at once on any rank) when the partitioner says it may (``Partitioner.gathers_for_16bit_save``:
ZeRO's answer is ``zero_optimization.stage3_gather_16bit_weights_on_model_save``),
and otherwise nothing is written and the call returns False with a warning, as DeepSpeed does (the
sharded checkpoint plus ``zkit consolidate`` is the way out that needs no gathering).

The engine reaches these through the hooks ``zkit_save_16bit_model`` and
``zkit_consolidated_16bit_state_dict`` (:mod:`zkit.checkpoint.plugin` answers them).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zkit.checkpoint.files import atomic_torch_save, fs_error
from zkit.core.verdicts import agreed

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

log = logging.getLogger("zkit")


def save_16bit_model(engine: "Engine", path: Path, exclude_frozen_parameters: bool) -> bool:
    zero3 = engine.partitioner.stage == 3
    if zero3 and not engine.partitioner.gathers_for_16bit_save():
        log.warning(
            "did not save the model %s: at ZeRO stage 3 it needs stage3_gather_16bit_weights_on_model_save: true "
            "(or save_checkpoint and `zkit consolidate`)",
            path,
        )
        return False
    state = _state_on_rank0(engine, zero3, exclude_frozen_parameters)
    world = getattr(engine, "world_comm", engine.comm)
    with agreed(world, f"saving the model to {path}"):  # a failed write fails every rank's call
        if state is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise fs_error(path.parent, "creating the directory", exc) from exc
            atomic_torch_save(state, path)
    return True


def consolidated_16bit_state_dict(engine: "Engine", exclude_frozen_parameters: bool) -> dict:
    """The model's ``state_dict`` in its training dtype, whole, on the host of rank 0 (empty
    elsewhere); partitioned parameters gathered one module at a time. ZeRO stage 3 only, as
    DeepSpeed's ``_zero3_consolidated_16bit_state_dict``; every rank must call it."""
    if engine.partitioner.stage != 3:
        raise ValueError("consolidated_16bit_state_dict requires ZeRO stage 3 (at stages 0-2 every rank holds "
                         "the whole model: use engine.module.state_dict())")
    return _state_on_rank0(engine, True, exclude_frozen_parameters) or {}


def _state_on_rank0(engine: "Engine", zero3: bool, exclude_frozen_parameters: bool) -> dict | None:
    """The whole state dict on rank 0's host, None on the other ranks (which take part)."""
    engine.wait_for_parameters()
    world = getattr(engine, "world_comm", engine.comm)
    state = _gathered_state_dict(engine.partitioner, engine.module, zero3, keep=world.rank == 0)
    if exclude_frozen_parameters:
        frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state if world.rank == 0 else None


def _gathered_state_dict(partitioner: Any, module: torch.nn.Module, zero3: bool, keep: bool) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` on the host, partitioned parameters gathered one module at a time
    (every rank takes part in each gather; only ``keep`` ranks keep the copies)."""
    if not zero3:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if keep else {}
    values: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        with partitioner.gathered(own):
            if keep:
                for p in own:
                    values.setdefault(id(p), p.detach().cpu().clone())
    if not keep:
        return {}
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        out[name] = values[id(value)] if id(value) in values else value.detach().cpu().clone()
    return out
