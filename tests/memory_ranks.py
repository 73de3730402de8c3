"""Rank function for the memory-at-rest test (module level: ranks are spawned processes)."""
from __future__ import annotations

import gc

import torch

import zkit
from zkit.models import GPT, GPTConfig
from zkit.telemetry.live_tensors import live_tensor_bytes


def live_bytes_after_steps(stages: list[int], dtype: str) -> dict[int, tuple[int, int]]:
    """Per stage: (parameters, live tensor bytes the engine adds) after two steps. What earlier
    stages' engines leave behind is in the baseline, so stages can share one process."""
    out = {}
    for stage in stages:
        gc.collect()
        baseline = live_tensor_bytes()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
        psi = sum(p.numel() for p in model.parameters())
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000,
        }
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = zkit.initialize(model=model, config=cfg)
        del model
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(engine.rank))
        for _ in range(2):
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
        del loss
        gc.collect()
        out[stage] = (psi, live_tensor_bytes() - baseline)
        engine.close()
    return out
