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
    """The identity, whose backward puts ``value`` (NaN, infinity) into element 3 of the gradient
    when told to: a bad gradient under a finite loss."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, poison: bool, value: float = float("nan")) -> torch.Tensor:
        ctx.poison, ctx.value = poison, value
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.poison:
            grad = grad.clone()
            grad.view(-1)[3] = ctx.value
        return grad, None, None


class _PoisonedLinear(torch.nn.Module):
    """Its parameters in backward order: second.bias (4), second.weight (32), first.bias (8),
    first.weight (64). In one unit over 2 ranks (stages 0-2) rank 0's shard is second.bias,
    second.weight, first.bias, the first 10 elements of first.weight: first.bias is a piece in
    the middle of it. At stage 3 ``first`` is the second unit."""

    def __init__(self, target: str = "second.weight", value: float = float("nan")) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)
        self.poison, self.target, self.value = False, target, value

    def _maybe_bad(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return _NanGrad.apply(p, self.poison, self.value) if name == self.target else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self._maybe_bad("first.bias", self.first.bias)
        h = torch.relu(torch.nn.functional.linear(x, self.first.weight, b1))
        w2 = self._maybe_bad("second.weight", self.second.weight)
        return torch.nn.functional.linear(h, w2, self.second.bias)


def nan_gradient_under_a_finite_loss(stages: list[int], dtype: str, target: str = "second.weight",
                                     value: float = float("nan")) -> dict:
    """At each stage: a good step, then two steps where rank 1's backward puts ``value`` into one
    element of ``target``'s gradient while every loss stays finite. With ``nonfinite_steps_limit``
    1 the first is skipped on every rank and the second stops the job naming the step."""
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = _PoisonedLinear(target, value)
        # printing every step reads every step's verdict at that step: the stop comes at step 3
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": stage}, "steps_per_print": 1, "nonfinite_steps_limit": 1}
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


def padding_of_reduced_shards(stages: list[int]) -> dict:
    """At each stage, two micro-steps on odd-sized units: how many elements of this rank's reduced
    gradient shards lie outside the pieces it owns (padding), and how many of them are not zero."""
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))  # 15 + 6 elements
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
        engine, *_ = zkit.initialize(model=model, config=cfg)
        padding = {"elements": 0, "nonzero": 0}
        for step in range(2):
            for micro in range(2):
                x = torch.full((2, 4), 1.0 + engine.rank + step, dtype=engine.dtype)
                engine.backward(engine(x).float().pow(2).mean())
                if micro == 1:  # the batch's last backward: its gradients are reduced
                    part = engine.partitioner
                    shards = [g.clone() for g in part.reduced_grad_shards()]
                    for _, unit, a, b, _ in part.owned:
                        shards[unit][a:b] = 0
                    padding["elements"] += sum(g.numel() for g in shards) - sum(b - a for _, _, a, b, _ in part.owned)
                    padding["nonzero"] += sum(int(torch.count_nonzero(g)) for g in shards)
                engine.step()
        engine.close()
        out[stage] = padding
    return out
