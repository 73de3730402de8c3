"""Rank functions for the offloaded-training tests (module level: ranks are spawned processes).

The model and batches follow ``tests/engine_ranks.py``: a tiny tied-embedding net with uneven
parameter sizes, and a global batch that every rank slices like a DistributedSampler would, so
``micro`` x ``world`` samples make the same global batch for any world size.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import zkit

DTYPES = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}
VOCAB = 13


class TiedNet(torch.nn.Module):
    """Embedding tied to the output head, a parameter used twice, uneven sizes."""

    def __init__(self, vocab: int = VOCAB, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.mix(h))
        h = self.norm(torch.tanh(self.mix(h)) + h)
        logits = h @ self.embed.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def make_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def config(stage: int, dtype: str, world: int, offload: str = "none", nvme_path: str | None = None,
           micro: int = 2, **extra) -> dict:
    """Small buckets and sub-groups so that every rank owns several pieces in several sub-groups."""
    zero: dict = {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": True, "sub_group_size": 50}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100)
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path, "buffer_count": 2}
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
        **DTYPES[dtype],
    }
    cfg.update(extra)
    return cfg


def global_batches(steps: int, per_step: int, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (steps * per_step, seq), generator=g)
    labels = torch.randint(0, VOCAB, (steps * per_step, seq), generator=g)
    return ids, labels


def train(engine, steps: int, micro: int, start: int = 0, between=None) -> list[float]:
    """``steps`` optimizer steps; rank r takes rows [r*micro, (r+1)*micro) of each global batch.
    ``between()`` runs after every step (to look at swap files mid-training)."""
    world, rank = engine.world_size, engine.rank
    ids, labels = global_batches(start + steps, micro * world)
    losses = []
    for step in range(start, start + steps):
        first = (step * world + rank) * micro
        loss = engine(ids[first : first + micro], labels[first : first + micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if between is not None:
            between()
    return losses


def params_of(engine) -> list[torch.Tensor]:
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # stage 3: gather first
        return [p.detach().float().clone() for p in engine.module.parameters()]


def swap_files(engine) -> list[str]:
    swapper = engine.allocator.swapper
    return sorted(p.name for p in swapper.dir.glob("*.swp")) if swapper.dir.exists() else []


def training_matrix(cases: list[tuple[int, str, str]], nvme_root: str, steps: int = 3) -> dict:
    """Train every (stage, dtype, offload device); return final parameters and losses, and for
    NVMe the swap files seen after each step and whether the run directory is gone after close."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, device in cases:
        cfg = config(stage, dtype, world, device, nvme_root if device == "nvme" else None)
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        seen: list[list[str]] = []
        between = (lambda: seen.append(swap_files(engine))) if device == "nvme" else None
        losses = train(engine, steps, 2, between=between)
        result = {"params": params_of(engine), "losses": losses, "allocator": engine.records["allocator"].name,
                  "optimizer": type(engine.optimizer).__name__}
        if device == "nvme":
            state = engine.optimizer.state
            result.update(swap_files=seen, state_type=type(state).__name__,
                          resident_tensors=sum(t.numel() for st in state.values() for t in st.values()
                                               if torch.is_tensor(t) and t.dim() > 0),
                          swap_dir=str(engine.allocator.swapper.dir))
        engine.close()
        if device == "nvme":
            result["swap_dir_after_close"] = Path(result["swap_dir"]).exists()
        out[(stage, dtype, device)] = result
    return out


def checkpoint_then_continue(root: str, cases: list[tuple[int, str]], nvme_root: str) -> dict:
    """Per (stage, offload device): train 2 steps, save under ``root``, train 2 more: the
    uninterrupted run a resumed one must match."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, device in cases:
        engine, *_ = zkit.initialize(model=make_model(), config=config(stage, "fp32", world, device, nvme_root))
        train(engine, 2, 2)
        engine.save_checkpoint(f"{root}/{stage}-{device}")
        losses = train(engine, 2, 2, start=2)
        out[(stage, device)] = {"losses": losses, "params": params_of(engine)}
        engine.close()
    return out


def resume(root: str, cases: list[tuple[int, str]], nvme_root: str) -> dict:
    """Load each case's checkpoint on any world size (2 ranks x micro 2 or 1 rank x micro 4 make
    the same global batch) and train the 2 steps after it."""
    world = torch.distributed.get_world_size()
    micro = 4 // world
    out = {}
    for stage, device in cases:
        torch.manual_seed(999)  # a different init: everything must come from the checkpoint
        cfg = config(stage, "fp32", world, device, nvme_root, micro=micro)
        engine, *_ = zkit.initialize(model=TiedNet(), config=cfg)
        engine.load_checkpoint(f"{root}/{stage}-{device}")
        steps = engine.global_steps
        losses = train(engine, 2, micro, start=2)
        out[(stage, device)] = {"losses": losses, "params": params_of(engine), "steps": steps}
        engine.close()
    return out
