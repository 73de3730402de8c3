"""Rank functions for tests/test_compat_deepspeed.py (importable by spawned ranks)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def comm_collectives() -> dict:
    """deepspeed.comm's functions on a real group, next to what torch.distributed gives."""
    import deepspeed
    from deepspeed import comm as dist

    deepspeed.init_distributed()  # already initialised by the test harness: a no-op
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out = torch.empty(world)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    rs = torch.empty(1)
    dist.reduce_scatter_tensor(rs, torch.arange(world, dtype=torch.float32) + rank)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=world - 1)
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    return {"rank": rank, "world": world, "sum": t.item(), "gathered": out.tolist(), "rs": rs.item(),
            "bcast": b.item(), "objs": objs, "ranks": dist.get_all_ranks_from_group(), "init": dist.is_initialized()}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _config(tmp: str) -> str:
    path = Path(tmp) / "ds_config.json"
    if not path.exists():
        path.write_text(json.dumps({
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2},
        }))
    return str(path)


def script_with_args(tmp: str) -> dict:
    """A DeepSpeedExamples-style script: add_config_arguments, initialize(args=..., model=...,
    model_parameters=...), the engine's accessors, train two steps."""
    import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", _config(tmp)])
    torch.manual_seed(0)
    net = _Net()
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    torch.manual_seed(1 + engine.global_rank)
    losses = []
    for _ in range(2):
        x = torch.randn(2, 6, device=engine.device)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"stage": engine.zero_optimization_stage(), "dp": engine.dp_world_size, "rank": engine.global_rank,
            "local_rank": engine.local_rank, "losses": losses}


def full_state_by_parameter(stage: int) -> dict:
    """DeepSpeed's safe_get/set_full_* on a trained engine, and the ZeRO-3 ds_* attributes."""
    import zkit
    from deepspeed import utils
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from zkit.zero import GatheredParameters

    torch.manual_seed(0)
    net = _Net()
    engine, *_ = zkit.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(4, 6, generator=g)[2 * engine.rank:2 * engine.rank + 2]
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    out: dict = {"fp32": {}, "exp_avg_sq": {}}
    params = dict(net.named_parameters())
    for name, p in params.items():
        out["fp32"][name] = utils.safe_get_full_fp32_param(p)
        out["exp_avg_sq"][name] = utils.safe_get_full_optimizer_state(p, "exp_avg_sq")
    with GatheredParameters(list(net.parameters())):
        out["gathered"] = {n: p.detach().clone() for n, p in params.items()}
    w = params["a.weight"]
    if stage == 3:
        out["ds"] = {"numel": w.ds_numel, "shape": tuple(w.ds_shape), "status": w.ds_status.name,
                     "local": w.ds_tensor.numel(), "ids": len({p.ds_id for p in params.values()})}
        with GatheredParameters([w]):
            out["ds"]["status_gathered"] = w.ds_status.name
        assert ZeroParamStatus.AVAILABLE.name == "AVAILABLE"
    utils.safe_set_full_fp32_param(w, torch.full((8, 6), 0.5))
    with GatheredParameters([w]):
        out["after_set"] = w.detach().clone()
    out["after_set_master"] = utils.safe_get_full_fp32_param(w)
    engine.close()
    return out


def checkpoint_edge_cases(tmp: str, stage: int) -> dict:
    """DeepSpeed's ZeRO save/load edge cases: save before any step, load right after building,
    and save in the middle of gradient accumulation (a backward not at a boundary)."""
    import zkit

    def build():
        torch.manual_seed(0)
        engine, *_ = zkit.initialize(model=_Net(), config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
        return engine

    out = {}
    engine = build()
    engine.save_checkpoint(f"{tmp}/immediate")  # no step taken yet
    fresh = build()
    fresh.load_checkpoint(f"{tmp}/immediate")  # and loaded before any step
    out["immediate"] = fresh.global_steps
    fresh.close()
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()  # micro-step 1 of 2: not a boundary
    out["boundary_before_save"] = engine.is_gradient_accumulation_boundary()
    from zkit.checkpoint import CheckpointError

    try:  # the accumulated gradients are not in a checkpoint: refused (DeepSpeed saves, resumes without them)
        engine.save_checkpoint(f"{tmp}/mid")
    except CheckpointError as exc:
        out["mid_refused"] = str(exc)
    engine.backward(engine(x).pow(2).mean())
    engine.step()  # the boundary: the accumulated step goes on after the refused save
    out["steps_after"] = engine.global_steps
    engine.save_checkpoint(f"{tmp}/mid")
    engine.close()
    again = build()
    again.load_checkpoint(f"{tmp}/mid")
    out["loaded_micro_steps"] = again.micro_steps
    again.close()
    return out
