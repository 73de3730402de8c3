"""Rank functions of the pipeline tests (module level so spawned ranks can import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zkit_pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from zkit_pipeline.interpreter import PipelineRunner
from zkit_pipeline.schedules import BUILTIN_SCHEDULES

WIDTH, MICRO, BATCH, STEPS, LR = 6, 4, 2, 2, 0.1


class SeededLinear(nn.Linear):
    """Same initial weights wherever and in whatever order it is built."""

    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__(n_in, n_out)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.normal_(0, 0.5, generator=gen)
            self.bias.normal_(0, 0.1, generator=gen)


def tied_head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight.t())


def layer_list():
    return [
        TiedLayerSpec("tie", SeededLinear, WIDTH, WIDTH, 0),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 1),
        nn.Tanh(),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 2),
        nn.Tanh(),
        LayerSpec(SeededLinear, WIDTH, WIDTH, 3),
        TiedLayerSpec("tie", SeededLinear, WIDTH, WIDTH, 0, forward_fn=tied_head),
    ]


def reference_layers():
    """The same model in one process: the tied module appears twice."""
    specs = layer_list()
    tie = specs[0].build()
    out = []
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            out.append(tie if spec.forward_fn is None else (lambda x, t=tie: tied_head(t, x)))
        elif isinstance(spec, LayerSpec):
            out.append(spec.build())
        else:
            out.append(spec)
    return out, tie


def data():
    gen = torch.Generator().manual_seed(3)
    return [[(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
             for _ in range(MICRO)] for _ in range(STEPS)]


def train_reference():
    layers, tie = reference_layers()
    params = list({id(p): p for f in layers if isinstance(f, nn.Module) for p in f.parameters()}.values())
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for batch in data():
        total = 0.0
        for x, y in batch:
            for f in layers:
                x = f(x)
            loss = F.mse_loss(x, y)
            (loss / MICRO).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / MICRO)
    return layers, tie, losses


def train_pipeline(schedule: str, virtual_stages: int, checkpoint_interval: int = 0) -> dict:
    rank = dist.get_rank()
    module = PipelineModule(layer_list(), dist.get_world_size(), F.mse_loss, stage_id=rank,
                            partition_method="uniform", virtual_stages=virtual_stages,
                            activation_checkpoint_interval=checkpoint_interval)
    opt = torch.optim.SGD(module.parameters(), lr=LR)

    def step():
        opt.step()
        opt.zero_grad()

    runner = PipelineRunner(module, BUILTIN_SCHEDULES[schedule], MICRO, step=step)
    losses = [float(runner.train_batch(iter(batch))) for batch in data()]
    ref_layers, ref_tie, ref_losses = train_reference()
    worst = 0.0
    for c in range(virtual_stages):
        start, end = module.layer_range(c)
        mine = list(module._funcs[c])
        for layer, ref in zip(mine, ref_layers[start:end]):
            if isinstance(ref, nn.Module) and isinstance(layer, nn.Linear):
                for a, b in zip(layer.parameters(), ref.parameters()):
                    worst = max(worst, float((a - b).abs().max()))
    tie_diff = max((float((a - b).abs().max()) for a, b in
                    zip(module.tied_modules["tie"].parameters(), ref_tie.parameters())), default=0.0)
    tied = module.tied_modules["tie"].weight.detach().clone() if "tie" in module.tied_modules else None
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": worst, "tie_diff": tie_diff, "tied": tied}


def all_schedules() -> dict:
    """Every schedule in one job: starting ranks costs far more than training this model."""
    runs = {name: train_pipeline(name, 2 if name == "interleaved_1f1b" else 1) for name in BUILTIN_SCHEDULES}
    runs["1f1b+checkpointing"] = train_pipeline("1f1b", 1, checkpoint_interval=1)
    return runs
