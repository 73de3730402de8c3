"""Rank functions of the LAMB x tensor-parallelism tests: a small MLP split over the tensor axis,
trained through ``zkit.initialize`` with LAMB, against the same MLP trained whole in one process
with :class:`zkit.optim.lamb.Lamb` on the same global batches."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zkit
from zkit.optim.lamb import Lamb
from zkit_pipeline import ProcessGrid, TensorParallelModule
from zkit_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

LAMB = {"lr": 0.02, "weight_decay": 0.01}
ROWS = 8  # global batch


class MLP(nn.Module):
    """Column- and row-parallel layers (sliced), a LayerNorm and a head (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.proj = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(torch.tanh(self.fc(x))) + x))


def dense_model() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():  # norms of different sizes, so trust ratios differ per parameter
        model.norm.weight.mul_(1.5)
        model.proj.bias.add_(0.1)
    return model


def split(model: MLP, tp) -> MLP:
    model.fc = ColumnParallelLinear.from_dense(model.fc, tp)
    model.proj = RowParallelLinear.from_dense(model.proj, tp)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def train_dense(steps: int, lamb: dict) -> dict[str, torch.Tensor]:
    """The reference: the whole MLP, the whole batch, one process."""
    model = dense_model()
    opt = Lamb(model.parameters(), **lamb)
    for step in range(steps):
        x, y = batch(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def whole(model: MLP, group) -> dict[str, torch.Tensor]:
    """This rank's parameters with the sliced ones put together over the tensor ``group``."""
    out = {}
    for name, p in model.named_parameters():
        p = p.detach().contiguous()
        if getattr(p, "tensor_parallel", False) or getattr(model.get_parameter(name), "tensor_parallel", False):
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, p, group=group)
            p = torch.cat(parts, dim=1 if name == "proj.weight" else 0)
        out[name] = p.clone()
    return out


def config(stage: int, offload: str, lamb: dict, data: int) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 20}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": ROWS // data, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Lamb", "params": lamb}, "zero_optimization": zero}


def train_tensor_parallel(stage: int, offload: str, steps: int, lamb: dict) -> dict[str, torch.Tensor]:
    tensor = 2
    data = dist.get_world_size() // tensor
    module = TensorParallelModule(lambda tp: split(dense_model(), tp), ProcessGrid(data=data, tensor=tensor))
    engine, *_ = zkit.initialize(model=module, config=config(stage, offload, lamb, data))
    rows = ROWS // data
    first = module.coord.data * rows
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(engine(x[first : first + rows]), y[first : first + rows])
        engine.backward(loss)
        engine.step()
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        out = whole(module.module, module.grid_groups["tensor"])
    engine.close()
    return out


def max_relative_diffs(cases: list[tuple[int, str, str]], steps: int = 4) -> dict:
    """Per (stage, offload device, LAMB variant): the largest difference of any parameter from
    the dense run, relative to that parameter's largest element."""
    variants = {"lamb": LAMB, "lamb_clip": {**LAMB, "max_grad_norm": 0.05}}
    dense = {name: train_dense(steps, lamb) for name, lamb in variants.items()}
    # the clipped variant clips: it ends elsewhere than the unclipped one
    out = {"clip_changes": max((dense["lamb"][n] - dense["lamb_clip"][n]).abs().max().item() for n in dense["lamb"])}
    for stage, offload, variant in cases:
        got = train_tensor_parallel(stage, offload, steps, variants[variant])
        ref = dense[variant]
        assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
        out[(stage, offload, variant)] = max(
            ((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
    return out

