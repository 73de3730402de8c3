"""Rank function of the composition matrix (tests/test_composition.py)."""
from __future__ import annotations

import traceback

import torch

import composition as matrix


class Blocks(torch.nn.Module):
    """Two residual MLP blocks; with ``ckpt`` each block runs through zkit.checkpointing."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)) for _ in range(2)
        )
        self.out = torch.nn.Linear(16, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zkit import checkpointing

        h = self.inp(x)
        for block in self.blocks:
            h = h + (checkpointing.checkpoint(block, h) if self.ckpt else block(h))
        return self.out(h)


STEPS = 3


def _run(features: tuple[str, ...], nvme_path: str) -> dict:
    import zkit
    from zkit.zero import GatheredParameters

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    cfg = matrix.config(features, nvme_path)
    model = Blocks(ckpt="act_ckpt" in features)
    kwargs = {}
    if "client_sgd" in features:
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    try:
        engine, *_ = zkit.initialize(model=model, config=cfg, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        dtype = engine.dtype
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2 * world, 8, generator=g)
            y = torch.randn(2 * world, 4, generator=g)
            mine_x, mine_y = x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]
            for m in range(accum):
                xs, ys = mine_x[m * micro:(m + 1) * micro], mine_y[m * micro:(m + 1) * micro]
                loss = (engine(xs.to(dtype)).float() - ys).pow(2).mean()
                engine.backward(loss)
                engine.step()
        with GatheredParameters(list(model.parameters())):
            params = [p.detach().float().clone() for p in model.parameters()]
        return {"params": params}
    except Exception:  # noqa: BLE001 - a crash after initialize is what the matrix must not have
        return {"crashed": traceback.format_exc(limit=6)}
    finally:
        engine.close()


def run_cells(cells: list[tuple[str, ...]], nvme_path: str) -> dict:
    """Every cell (a tuple of features) in one process group, in order."""
    return {cell: _run(cell, nvme_path) for cell in cells}
