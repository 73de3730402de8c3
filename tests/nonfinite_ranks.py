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


class _NanGrad(torch.autograd.Function):
    """The identity, whose backward puts a NaN into the gradient when told to: a bad gradient
    under a finite loss."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, poison: bool) -> torch.Tensor:
        ctx.poison = poison
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.poison:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad, None


class _PoisonedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _NanGrad.apply(self.second.weight, self.poison)
        return torch.nn.functional.linear(torch.relu(self.first(x)), w, self.second.bias)


def nan_gradient_under_a_finite_loss(stages: list[int], dtype: str) -> dict:
    """At each stage: a good step, then two steps where rank 1's backward makes one gradient NaN
    while every loss stays finite. With ``nonfinite_steps_limit`` 1 the first is skipped on every
    rank and the second stops the job naming the step."""
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = _PoisonedLinear()
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": stage}, "steps_per_print": 1000, "nonfinite_steps_limit": 1}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = zkit.initialize(model=model, config=cfg)
        seen, error = [], None
        for step in range(3):
            model.poison = step > 0 and engine.rank == 1
            x = torch.ones(2, 8, dtype=engine.dtype)
            before = [p.detach().float().clone() for p in engine.module.parameters()]
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            try:
                engine.step()
            except FloatingPointError as exc:
                error = str(exc)
                break
            after = engine.module.parameters()
            seen.append((bool(torch.isfinite(loss)), engine.was_step_applied(),
                         all(torch.equal(a, b.float()) for a, b in zip(before, after))))
        finite = all(torch.isfinite(p).all().item() for p in engine.module.parameters())
        engine.close()
        out[stage] = {"steps": seen, "error": error, "finite": finite}
    return out
