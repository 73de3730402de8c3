"""Rank functions for tests/test_compat_deepspeed.py (importable by spawned ranks)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def comm_collectives() -> dict:
    """deepspeed.comm's functions on a real group, next to what torch.distributed gives."""
    import zkit.compat.deepspeed as deepspeed
    from zkit.compat.deepspeed import comm as dist

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
    import zkit.compat.deepspeed as deepspeed

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
