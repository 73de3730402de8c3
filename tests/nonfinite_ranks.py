"""Rank function for the non-finite step tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch

import zkit


def skip_when_one_rank_sees_nan(stage: int, dtype: str) -> dict:
    """Rank 1 gets a NaN input at the second step: every rank skips that step, together."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    seen = []
    for step in range(3):
        x = torch.ones(2, 8, dtype=engine.dtype)
        if step == 1 and engine.rank == 1:
            x[0, 0] = float("nan")
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        after = list(engine.module.parameters())
        seen.append((engine.was_step_applied(), all(torch.equal(a, b.float()) for a, b in zip(before, after))))
    finite = all(torch.isfinite(p).all().item() for p in engine.module.parameters())
    engine.close()
    return {"steps": seen, "skipped": engine.skipped_steps, "finite": finite}
