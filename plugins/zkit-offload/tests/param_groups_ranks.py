"""Rank functions for NVMe optimizer offload with several param groups (module level: ranks are
spawned processes). The groups are the two Hugging Face's Trainer builds: weights with decay,
biases and norms without."""
from __future__ import annotations

import torch

import zkit

import offload_ranks as orr

DECAY = 0.1


def param_groups(model: torch.nn.Module, no_decay: float = 0.0) -> list[dict]:
    """Matrices decay by :data:`DECAY`, vectors by ``no_decay`` (0 as the Trainer does)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": no_decay}]


def _engine(stage: int, device: str, nvme_root: str, micro: int, seed: int = 0, no_decay: float = 0.0):
    model = orr.make_model(seed)
    cfg = orr.config(stage, "fp32", torch.distributed.get_world_size(), device,
                     nvme_root if device == "nvme" else None, micro=micro)
    engine, *_ = zkit.initialize(model=model, model_parameters=param_groups(model, no_decay), config=cfg)
    return engine


def grouped_runs(nvme_root: str, ckpt_root: str, stages: list[int]) -> dict:
    """Per stage: final parameters and losses of 4 steps with two param groups and the optimizer
    offloaded to NVMe, to the CPU, not at all, and on NVMe with one decay for both groups; the
    NVMe run is saved after 2 steps and loaded into a fresh NVMe run that trains the last 2."""
    micro = 4 // torch.distributed.get_world_size()
    out = {}
    for stage in stages:
        path = f"{ckpt_root}/stage{stage}"
        for device, no_decay in (("nvme", 0.0), ("cpu", 0.0), ("none", 0.0), ("nvme", DECAY)):
            engine = _engine(stage, device, nvme_root, micro, no_decay=no_decay)
            losses = orr.train(engine, 2, micro)
            if (device, no_decay) == ("nvme", 0.0):
                engine.save_checkpoint(path)
            losses += orr.train(engine, 2, micro, start=2)
            out[(stage, device, no_decay)] = {"losses": losses, "params": orr.params_of(engine),
                                              "allocator": engine.records["allocator"].name}
            engine.close()
        engine = _engine(stage, "nvme", nvme_root, micro, seed=999)  # everything from the checkpoint
        engine.load_checkpoint(path)
        losses = orr.train(engine, 2, micro, start=2)
        out[(stage, "resumed")] = {"losses": losses, "params": orr.params_of(engine), "steps": engine.global_steps}
        engine.close()
    return out
