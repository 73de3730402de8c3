"""Rank functions of test_pipeline_onebit.py: 1-bit compression under ZeRO-2, with and without a
pipeline (module level so that spawned ranks import them)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit

WIDTH, MICRO, BATCH, STEPS = 64, 2, 4, 5
FREEZE = 2  # 1-bit Adam's warm-up steps: steps 3-5 reduce gradients 1-bit compressed


def layers() -> list[nn.Module]:
    """Four 64x64 layers: their weights (4096 elements) are compressed, their biases are not."""
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
            nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)]


def config(stage: int, optimizer: str, accumulation: int) -> dict[str, Any]:
    params = {"lr": 1e-3, "freeze_step": FREEZE} if optimizer == "OneBitAdam" else {"lr": 1e-3}
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": optimizer, "params": params},
        # one unit per parameter, so both runs compress the same tensors; a single scratch bucket,
        # so every unit of ZeRO-2 travels in the same one
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1, "overlap_comm": False},
    }


def data(replica: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(100 + replica)
    return [[(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
             for _ in range(micro)] for _ in range(STEPS)]


class _OverGroup(nn.Sequential):
    """The whole model, trained data-parallel over a given group of ranks."""

    def __init__(self, modules: list[nn.Module], group: Any) -> None:
        super().__init__(*modules)
        self.data_parallel_group = group


def _train_plain(model: nn.Module, cfg: dict[str, Any], batches, stack: Any = None) -> tuple[Any, list[float]]:
    engine, *_ = zkit.initialize(model=model, config=cfg, **({"stack": stack} if stack else {}))
    losses = []
    for step in batches:
        total = 0.0
        for x, y in step:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / len(step))
    return engine, losses


def pipeline_against_plain() -> dict[str, Any]:
    """4 ranks: 2 pipeline stages x 2 replicas, ZeRO-2 and 1-bit Adam; the reference is the same
    layers trained by a plain engine over this rank's data-parallel group (the stage's replicas)."""
    from zkit_pipeline import PipelineModule

    module = PipelineModule(layers(), 2, F.mse_loss, partition_method="uniform")
    replica = module.grid.coord(dist.get_rank()).data
    batches = data(replica, MICRO)
    engine, *_ = zkit.initialize(model=module, config=config(2, "OneBitAdam", MICRO))
    returned = [engine.train_batch(iter(step)) for step in batches]
    reference, ref_losses = _train_plain(_OverGroup(layers(), module.data_parallel_group),
                                         config(2, "OneBitAdam", MICRO), batches)
    start, end = module.layer_range(0)
    mine = [p for f in module._funcs[0] for p in f.parameters()]
    theirs = [p for f in list(reference.module)[start:end] for p in f.parameters()]
    out = {
        "frozen": engine.optimizer.frozen,
        "compressed": engine.comm_stats().get("reduce_scatter_1bit", {}).get("calls", 0),
        "worst": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, theirs)),
        "moved": max(float((a - b).abs().max()) for a, b in zip(mine, (p for f in layers()[start:end] for p in f.parameters()))),
        "losses": [float(v) for v in returned],
        "requires_grad": any(v.requires_grad for v in returned),
        "replica": replica,
        "replica_losses": ref_losses,
    }
    engine.close()
    reference.close()
    return out


def onebit_communicator_stage2_against_stage1() -> dict[str, Any]:
    """2 ranks: Adam over the 'onebit' communicator (compressed from the first backward), ZeRO-2
    (units travel in one reused scratch bucket) against ZeRO-1 (each unit its own buffer)."""
    batches = data(dist.get_rank(), 1)
    runs = {}
    for stage in (1, 2):
        engine, _ = _train_plain(nn.Sequential(*layers()), config(stage, "Adam", 1), batches,
                                 zkit.Stack(communicator="onebit"))
        runs[stage] = {
            "params": torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]),
            "keys": sorted(engine.comm._feedback),
            "compressed": engine.comm_stats()["reduce_scatter_1bit"]["calls"],
        }
        engine.close()
    return runs
