"""The model and data of the DeepSpeed checkpoint import test, plain PyTorch: imported by the
DeepSpeed side (run in DeepSpeed's own interpreter) and by the zkit side alike.

Sizes are odd on purpose: DeepSpeed pads every parameter to 16 bytes and every flat group to a
multiple of the world size, and the import must see through both paddings."""
from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 7, 13, 3
#: samples per global batch (split evenly over the ranks)
GLOBAL_BATCH = 8


class PeerNet(nn.Module):
    """Three linear layers and a layer norm, with a buffer (which a checkpoint carries as well)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, OUT))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.mid(h)) + h
        return nn.functional.mse_loss(self.out(h) + self.shift, y)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    share = GLOBAL_BATCH // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def ds_config(stage: int, world_size: int, dtype: str = "fp32", offload: bool = False) -> dict:
    """DeepSpeed's config for the run; zkit reads the same dict."""
    cfg: dict = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 5, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        # explicit: DeepSpeed 0.19's default is 1.0, zkit's 0 (off)
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
    }
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload:  # DeepSpeed's CPU Adam steps the offloaded partitions (torch_adam is refused there)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        del cfg["optimizer"]["params"]["torch_adam"]
    return cfg


def pipe_layers(pipe) -> list:
    """The same kind of network as a pipeline: ``pipe`` is ``deepspeed.pipe``, DeepSpeed's or
    zkit's drop-in's (zkit-pipeline). A tied layer runs twice, so the stages that hold it
    keep copies of one weight."""
    torch.manual_seed(0)
    return [
        pipe.LayerSpec(nn.Linear, IN, HIDDEN),
        pipe.TiedLayerSpec("mix", nn.Linear, HIDDEN, HIDDEN, bias=False),
        pipe.LayerSpec(nn.LayerNorm, HIDDEN),
        nn.Tanh(),
        pipe.LayerSpec(nn.Linear, HIDDEN, HIDDEN),
        pipe.TiedLayerSpec("mix", nn.Linear, HIDDEN, HIDDEN, bias=False),
        nn.Tanh(),
        pipe.LayerSpec(nn.Linear, HIDDEN, OUT),
    ]


def pipe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


#: micro-batches per global batch of a pipeline run
PIPE_MICRO = 2


def pipe_batches(step: int, dp_rank: int, dp_world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of global batch ``step``."""
    x, y = batch(step, dp_rank, dp_world)
    return list(zip(x.chunk(PIPE_MICRO), y.chunk(PIPE_MICRO)))


def pipe_config(stage: int, dp_world: int, dtype: str = "fp32") -> dict:
    cfg = ds_config(stage, dp_world, dtype)
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // dp_world // PIPE_MICRO
    cfg["gradient_accumulation_steps"] = PIPE_MICRO
    return cfg
