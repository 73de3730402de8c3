"""Rank functions of the engine tests: ``engine.train_batch`` of a PipelineModule under ZeRO
(module level so spawned ranks can import them)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit
from pp_ranks import SeededLinear, WIDTH, layer_list, reference_layers
from zkit_pipeline import LayerSpec, PipelineModule

MICRO, BATCH, STEPS, LR = 4, 2, 3, 0.01
CLIP = 0.05  # below the gradient norms of this model: clipping applies at every step
STAGES = 2


def untied_layers() -> list[Any]:
    return [
        LayerSpec(SeededLinear, WIDTH, WIDTH, 1),
        nn.Tanh(),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 2),
        nn.Tanh(),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 3),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 4),
    ]


def _reference_model(tied: bool) -> tuple[list[Any], list[nn.Parameter]]:
    if tied:
        layers, _ = reference_layers()
    else:
        layers = [spec.build() if isinstance(spec, LayerSpec) else spec for spec in untied_layers()]
    params = list({id(p): p for f in layers if isinstance(f, nn.Module) for p in f.parameters()}.values())
    return layers, params


def data(replicas: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][replica][micro-batch] -> (x, y)``: each data-parallel replica its own batches."""
    gen = torch.Generator().manual_seed(7)
    return [[[(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
              for _ in range(MICRO)] for _ in range(replicas)] for _ in range(STEPS)]


def train_reference(tied: bool, replicas: int, clip: float = 0.0) -> tuple[list[Any], list[list[float]]]:
    """Single-process AdamW on the whole global batch; per step, each replica's mean loss."""
    layers, params = _reference_model(tied)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)  # zkit's AdamW default
    losses = []
    for step in data(replicas):
        per_replica = []
        for batches in step:
            total = 0.0
            for x, y in batches:
                for f in layers:
                    x = f(x)
                loss = F.mse_loss(x, y)
                (loss / (MICRO * replicas)).backward()
                total += loss.item()
            per_replica.append(total / MICRO)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(per_replica)
    return layers, losses


def config(stage: int, clip: float = 0.0) -> dict[str, Any]:
    return {
        "gradient_clipping": clip,
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        # small buckets: several units per stage, so the reductions overlap backward
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
    }


def train_engine(stage: int, schedule: str = "1f1b", tied: bool = False, clip: float = 0.0) -> dict[str, Any]:
    """Train through ``engine.train_batch``; compare with :func:`train_reference` on this rank."""
    module = PipelineModule(
        layer_list() if tied else untied_layers(), STAGES, F.mse_loss,
        partition_method="uniform", schedule=schedule,
        virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
    )
    replicas = dist.get_world_size() // STAGES
    engine, *_ = zkit.initialize(model=module, config=config(stage, clip))
    replica = module.grid.coord(dist.get_rank()).data
    returned = [engine.train_batch(iter(step[replica])) for step in data(replicas)]
    losses = [float(loss) for loss in returned]
    ref_layers, ref_losses = train_reference(tied, replicas, clip)
    worst = 0.0
    for c in range(module.virtual_stages):
        start, end = module.layer_range(c)
        for layer, ref in zip(module._funcs[c], ref_layers[start:end]):
            if isinstance(layer, nn.Module) and any(True for _ in layer.parameters()):
                ref_params = ref.parameters() if isinstance(ref, nn.Module) else ref.__defaults__[0].parameters()
                for a, b in zip(layer.parameters(), ref_params):
                    worst = max(worst, float((a.detach() - b.detach()).abs().max()))
    out = {
        "losses": losses,
        # DeepSpeed's train_batch: the mean over the data-parallel replicas, detached
        "ref_losses": [sum(step) / len(step) for step in ref_losses],
        "loss_requires_grad": any(loss.requires_grad for loss in returned),
        "param_diff": worst,
        "dp_size": engine.world_size,
        "train_batch_size": engine.train_batch_size(),
        "global_steps": engine.global_steps,
        "grad_norm": engine.get_global_grad_norm(),
        "dp_comm": engine.comm_stats(),
        "world_comm": engine.world_comm.stats(),
    }
    engine.close()
    return out


def stage2_with_ties() -> str:
    """The refusal comes at initialize (the runner is built with the engine), not mid-batch."""
    module = PipelineModule(layer_list(), STAGES, F.mse_loss, partition_method="uniform")
    try:
        engine, *_ = zkit.initialize(model=module, config=config(2))
    except ValueError as exc:
        return str(exc)
    engine.close()
    return ""


def two_ranks() -> dict[Any, Any]:
    """Every 2-rank case in one job (starting ranks costs more than the training)."""
    runs: dict[Any, Any] = {(s, "1f1b", False): train_engine(s) for s in (0, 1, 2)}
    runs[(1, "1f1b", True)] = train_engine(1, tied=True)
    runs[(0, "zb_h1", True)] = train_engine(0, "zb_h1", tied=True)
    runs[(2, "interleaved_1f1b", False)] = train_engine(2, "interleaved_1f1b")
    runs[(2, "zb_h1", False)] = train_engine(2, "zb_h1")
    runs["stage2_ties"] = stage2_with_ties()
    runs[(1, "1f1b", "clip")] = train_engine(1, clip=CLIP)
    runs[(0, "1f1b", "tied-clip")] = train_engine(0, tied=True, clip=CLIP)
    return runs


def four_ranks() -> dict[Any, Any]:
    """2 pipeline stages x 2 data-parallel replicas."""
    runs: dict[Any, Any] = {(s, "1f1b", False): train_engine(s) for s in (0, 1, 2)}
    runs[(1, "1f1b", True)] = train_engine(1, tied=True)
    runs[(1, "zb_h1", False)] = train_engine(1, "zb_h1")
    runs[(2, "1f1b", "clip")] = train_engine(2, clip=CLIP)
    return runs
