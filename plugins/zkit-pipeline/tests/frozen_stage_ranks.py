"""Rank functions of the frozen-stage tests: a 2-stage pipeline one of whose stages has no
trainable parameter (every one frozen) trains like the same layers, frozen alike, in one process.
A frozen last stage still runs backward, passing gradients to the first."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit
from pp_engine_ranks import BATCH, LR, MICRO, STAGES, data, untied_layers
from zkit_pipeline import LayerSpec, PipelineModule

#: layers of each stage (the uniform split of untied_layers over 2 stages)
STAGE_LAYERS = (range(0, 3), range(3, 6))


def _freeze(layers: list[Any], frozen: int) -> None:
    """Freeze the layers of stage ``frozen``; ``layers`` are indexed globally (None elsewhere)."""
    for i, layer in enumerate(layers):
        if i in STAGE_LAYERS[frozen] and isinstance(layer, nn.Module):
            layer.requires_grad_(False)


def train_reference(replicas: int, clip: float, frozen: int) -> tuple[list[nn.Module], list[float]]:
    """Single-process AdamW on the whole global batch, the same layers frozen."""
    layers = [spec.build() if isinstance(spec, LayerSpec) else spec for spec in untied_layers()]
    _freeze(layers, frozen)
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for step in data(replicas):
        total = 0.0
        for batches in step:
            for x, y in batches:
                for f in layers:
                    x = f(x)
                loss = F.mse_loss(x, y)
                (loss / (MICRO * replicas)).backward()
                total += loss.item() / (MICRO * replicas)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return layers, losses


def train_frozen_stage(frozen: int, stage: int, clip: float = 0.0) -> dict[str, Any]:
    """Train with pipeline stage ``frozen`` frozen under ZeRO ``stage``; compare this rank's layers
    and the losses with :func:`train_reference`."""
    module = PipelineModule(untied_layers(), STAGES, F.mse_loss, partition_method="uniform")
    start, end = module.layer_range(0)
    assert (start, end) == (STAGE_LAYERS[module.stage_id][0], STAGE_LAYERS[module.stage_id][-1] + 1)
    _freeze([None] * start + list(module._funcs[0]), frozen)
    cfg = {"gradient_clipping": clip, "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    try:
        engine, *_ = zkit.initialize(model=module, config=cfg)
    except ValueError as exc:
        return {"refused": str(exc)}
    replicas = dist.get_world_size() // STAGES
    replica = module.grid.coord(dist.get_rank()).data
    losses = [float(engine.train_batch(iter(step[replica]))) for step in data(replicas)]
    ref_layers, ref_losses = train_reference(replicas, clip, frozen)
    worst = 0.0
    for layer, ref in zip(module._funcs[0], ref_layers[start:end]):
        for a, b in zip(getattr(layer, "parameters", list)(), getattr(ref, "parameters", list)()):
            worst = max(worst, float((a.detach() - b.detach()).abs().max()))
    out = {"losses": losses, "ref_losses": ref_losses, "param_diff": worst, "global_steps": engine.global_steps,
           "layers": (start, end), "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
           "grad_norm": engine.get_global_grad_norm()}
    engine.close()
    return out


def frozen_stage_runs(cases: list[tuple[int, int, float]]) -> dict:
    """(frozen pipeline stage, ZeRO stage, gradient clipping) -> :func:`train_frozen_stage`, and
    ``"all"`` -> :func:`every_stage_frozen`."""
    out: dict[Any, Any] = {case: train_frozen_stage(*case) for case in cases}
    out["all"] = every_stage_frozen()
    return out


def every_stage_frozen() -> str:
    """The refusal of a pipeline frozen on every stage (on every rank), or ''."""
    module = PipelineModule(untied_layers(), STAGES, F.mse_loss, partition_method="uniform")
    module.requires_grad_(False)
    try:
        engine, *_ = zkit.initialize(model=module, config={"train_micro_batch_size_per_gpu": BATCH,
                                                           "optimizer": {"type": "AdamW", "params": {"lr": LR}}})
    except ValueError as exc:
        return str(exc)
    engine.close()
    return ""
