"""Rank function of tests/test_fp16_accumulation.py: the tied GPT of the composition harness in
fp16 on 2 ranks, and the same math written out by hand in one process."""
from __future__ import annotations

import torch

from composition_models import Net, batch, loss

FEATURES = ("fp16", "tied_weights")
STEPS, SCALE, WORLD = 3, 2.0**8, 2


def _config(stage: int, accumulation: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2 // accumulation, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "fp16": {"enabled": True, "initial_scale_power": 8},
            "steps_per_print": 1000}


def _micro_batches(step: int, replica: int, accumulation: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``replica``'s 2 rows of the step's global batch of 4, in ``accumulation`` micro-batches."""
    x, y = batch(step, FEATURES)
    rows = 2 // accumulation
    return [(x[2 * replica + i: 2 * replica + i + rows], y[2 * replica + i: 2 * replica + i + rows])
            for i in range(0, 2, rows)]


def by_hand(accumulation: int) -> dict[str, torch.Tensor]:
    """fp16 weights, fp32 master and AdamW: each replica's loss x the scale / accumulation back-
    propagated into fp16 gradients that add up over its micro-batches, the replicas' sums averaged
    in fp16 (sum, then divide), the average unscaled into the master's step."""
    model = Net(FEATURES).to(torch.float16)
    params = list(model.parameters())  # the tied embedding once
    master = [p.detach().float().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        summed = [torch.zeros_like(p) for p in params]
        for replica in range(WORLD):
            for p in params:
                p.grad = None
            for xs, ys in _micro_batches(step, replica, accumulation):
                (loss(model(xs), ys).float() * SCALE / accumulation).backward()
            summed = [s + p.grad for s, p in zip(summed, params)]
        for m, s in zip(master, summed):
            m.grad = (s / WORLD).float() * (1.0 / SCALE)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def engine_run(stage: int, accumulation: int) -> dict:
    """zkit's run of the same steps on this rank's replica: its parameters, skipped steps, loss scale."""
    import zkit

    engine, *_ = zkit.initialize(model=Net(FEATURES), config=_config(stage, accumulation))
    for step in range(STEPS):
        for xs, ys in _micro_batches(step, torch.distributed.get_rank(), accumulation):
            engine.backward(loss(engine(xs), ys))
            engine.step()
    out = {"params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
           "skipped": engine.skipped_steps, "scale": engine.loss_scale}
    engine.close()
    return out


def runs(cases: list[tuple[int, int]]) -> dict:
    """Each ``(stage, accumulation)`` case by zkit, and rank 0's hand-written runs."""
    out = {case: engine_run(*case) for case in cases}
    if torch.distributed.get_rank() == 0:
        out["by_hand"] = {a: by_hand(a) for a in sorted({a for _, a in cases})}
    return out
