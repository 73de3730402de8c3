"""Rank functions of ``test_checkpoint_accumulation.py``."""
from __future__ import annotations

import torch

import zkit
from zkit.checkpoint import CheckpointError

MICRO = 2  # gradient_accumulation_steps


def _config(stage: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                         "warmup_num_steps": 2, "total_num_steps": 6}},
        "steps_per_print": 1000,
    }


def _engine(stage: int) -> zkit.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return zkit.initialize(model=model, config=_config(stage, torch.distributed.get_world_size()))[0]


def _micro(engine: zkit.Engine, step: int, micro: int) -> None:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + engine.rank)
    x, y = torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()


def _params(engine: zkit.Engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def save_inside_and_after_an_accumulation(tmp: str, stages: list[int]) -> dict:
    """Per stage: the refusal's text, and whether the run resumed from the save at the boundary
    ends where the uninterrupted run does."""
    out = {}
    for stage in stages:
        reference = _engine(stage)
        for step in range(3):
            for m in range(MICRO):
                _micro(reference, step, m)
        want = _params(reference)
        reference.close()

        engine = _engine(stage)
        for m in range(MICRO):
            _micro(engine, 0, m)
        _micro(engine, 1, 0)
        try:
            engine.save_checkpoint(f"{tmp}/{stage}", tag="inside")
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        _micro(engine, 1, 1)  # the batch goes on as if no save had been tried
        engine.save_checkpoint(f"{tmp}/{stage}", tag="boundary")
        engine.close()
        resumed = _engine(stage)
        resumed.load_checkpoint(f"{tmp}/{stage}", tag="boundary")
        for m in range(MICRO):
            _micro(resumed, 2, m)
        got = _params(resumed)
        out[stage] = {"refused": refused, "max_diff": max((a - b).abs().max().item() for a, b in zip(got, want)),
                      "lr": resumed.get_lr()[0], "lr_want": reference.get_lr()[0]}
        resumed.close()
    return out
