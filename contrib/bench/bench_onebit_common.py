"""Shared pieces of the zkit-onebit benchmarks: models, data and a training loop through
``zkit.initialize`` that records per-step wire bytes (the communicator's counters) and times."""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

CORPUS = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "austen.txt.gz")


def config_for(optimizer: str, lr: float, freeze_step: int, stage: int = 0, micro_batch: int = 4) -> dict:
    """A DeepSpeed-style config: ``optimizer`` is ``"Adam"``, ``"OneBitAdam"`` (``freeze_step``)
    or ``"ZeroOneAdam"`` (``var_freeze_step``)."""
    params: dict[str, Any] = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    if optimizer == "OneBitAdam":
        params["freeze_step"] = freeze_step
    elif optimizer == "ZeroOneAdam":
        params["var_freeze_step"] = freeze_step
    else:
        params["adam_w_mode"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage},
    }


def wide_mlp(width: int = 2048, depth: int = 3) -> torch.nn.Module:
    """A model whose step time is dominated by its gradient exchange: few FLOPs per parameter
    at a tiny batch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width // 2), torch.nn.GELU(), torch.nn.Linear(width // 2, width)]
    return torch.nn.Sequential(*layers)


def mlp_batch(step: int, rank: int, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, width, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def comm_bytes(stats: dict[str, dict[str, int]]) -> int:
    return sum(v["bytes"] for v in stats.values())


def train_steps(engine: Any, batches, steps: int, loss_fn) -> list[dict[str, float]]:
    """Run ``steps`` optimizer steps; per step: loss, seconds, bytes this rank put on the wire."""
    rows = []
    before = comm_bytes(engine.comm_stats())
    for step in range(steps):
        inputs, targets = batches(step)
        dist.barrier()
        t0 = time.perf_counter()
        loss = loss_fn(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t0
        after = comm_bytes(engine.comm_stats())
        rows.append({"step": step + 1, "loss": loss.item(), "seconds": seconds, "bytes": after - before})
        before = after
    return rows


def mse_loss(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(engine(x), y)


def lm_loss(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return engine(x, labels=y)


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(rows[0])
    with open(path, "w") as f:
        f.write(",".join(keys) + "\n")
        for row in rows:
            f.write(",".join(f"{row[k]:.6g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + "\n")
