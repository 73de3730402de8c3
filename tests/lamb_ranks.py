"""Rank functions for the sharded-LAMB tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import zkit
from zkit.optim.lamb import Lamb
from zkit.core.records import OptimizerRecord

import engine_ranks as er

LAMB = {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 5.0, "min_coeff": 0.05}


def groups_of(model: torch.nn.Module, split: bool) -> list[dict] | None:
    """Two param groups with different options, one of them clipping its gradients; or None."""
    if not split:
        return None
    mix = [model.mix.weight, model.mix.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in mix)]
    return [{"params": rest, "weight_decay": 0.0}, {"params": mix, "max_grad_norm": 0.3}]


def lamb_config(stage: int, dtype: str, gas: int, world: int, **lamb) -> dict:
    return er.config(stage, dtype, gas, world, optimizer={"type": "Lamb", "params": {**LAMB, **lamb}})


def lamb_matrix(cases: list[tuple[int, str, int, bool]], steps: int = 3) -> dict:
    """Train every (stage, dtype, gas, two param groups) case with LAMB on TiedNet, whose
    parameters straddle shard boundaries (``reduce_bucket_size`` 40)."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas, split in cases:
        model = er.make_model()
        cfg = lamb_config(stage, dtype, gas, world)
        if stage == 3:
            cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100)
        engine, *_ = zkit.initialize(model=model, model_parameters=groups_of(model, split), config=cfg)
        er.train_engine(engine, steps, gas, world)
        out[(stage, dtype, gas, split)] = (er.params_of(engine), engine.comm_stats(), len(engine.partitioner.owned))
        engine.close()
    return out


def reference(steps: int, gas: int, world: int, split: bool, micro: int = 2) -> list[torch.Tensor]:
    """Single-process LAMB on whole parameters and the same global batches."""
    model = er.make_model()
    opt = Lamb(groups_of(model, split) or model.parameters(), **LAMB)
    ids, labels = er.global_batches(steps, gas, world, micro)
    per_step = gas * world * micro
    for step in range(steps):
        opt.zero_grad()
        sl = slice(step * per_step, (step + 1) * per_step)
        model(ids[sl], labels[sl]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class Tiny(torch.nn.Module):
    """Three elements in all: on four ranks one of them owns no piece of any parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y)


def tiny_batches(steps: int, world: int, micro: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = steps * world * micro
    return torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)


def tiny_run(stage: int, steps: int = 4, micro: int = 2) -> dict:
    world = torch.distributed.get_world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "Lamb", "params": dict(LAMB, max_grad_norm=0.5)},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
        "steps_per_print": 1000,
    }
    engine, *_ = zkit.initialize(model=Tiny(), config=cfg)
    x, y = tiny_batches(steps, world, micro)
    for step in range(steps):
        first = (step * world + engine.rank) * micro
        engine.backward(engine(x[first : first + micro], y[first : first + micro]))
        engine.step()
    out = {"params": er.params_of(engine), "owned": len(engine.partitioner.owned)}
    engine.close()
    return out


def tiny_reference(world: int, steps: int = 4, micro: int = 2) -> list[torch.Tensor]:
    model = Tiny()
    opt = Lamb(model.parameters(), **dict(LAMB, max_grad_norm=0.5))
    x, y = tiny_batches(steps, world, micro)
    per_step = world * micro
    for step in range(steps):
        opt.zero_grad()
        sl = slice(step * per_step, (step + 1) * per_step)
        model(x[sl], y[sl]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def refuse_without_shard_norms(stage: int) -> str:
    """A non-elementwise optimizer that cannot assemble norms across ranks is refused."""
    world = torch.distributed.get_world_size()
    record = OptimizerRecord(
        name="layerwise_sgd", factory=lambda groups, **kw: torch.optim.SGD(groups, lr=0.1), elementwise=False
    )
    cfg = er.config(stage, "fp32", 1, world)
    del cfg["optimizer"]
    try:
        zkit.initialize(model=er.make_model(), config=cfg, stack=zkit.Stack(optimizer=record))
    except ValueError as e:
        return str(e)
    return "no error"


def comm_overhead(stage: int, steps: int = 3) -> dict:
    """Collective counts of LAMB minus AdamW on the same run: what the trust ratio costs."""
    world = torch.distributed.get_world_size()
    stats = {}
    for name, cfg in (("lamb", lamb_config(stage, "fp32", 1, world)), ("adamw", er.config(stage, "fp32", 1, world))):
        engine, *_ = zkit.initialize(model=er.make_model(), config=cfg)
        er.train_engine(engine, steps, 1, world)
        stats[name] = engine.comm_stats()
        engine.close()
    return stats


def two_rank_suite(cases: list[tuple[int, str, int, bool]]) -> dict:
    return {
        "matrix": lamb_matrix(cases),
        "comm": comm_overhead(1),
        "refused": {stage: refuse_without_shard_norms(stage) for stage in (1, 3)},
    }


def four_rank_suite(cases: list[tuple[int, str, int, bool]]) -> dict:
    return {"matrix": lamb_matrix(cases), "tiny": {stage: tiny_run(stage) for stage in (1, 2, 3)}}
