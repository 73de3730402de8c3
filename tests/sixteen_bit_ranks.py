"""Rank functions for the 16-bit state dict tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch

import zkit


def consolidated_stage3() -> dict:
    """A stage-3 engine's consolidated 16-bit state dict, and the gathered model's own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "bf16": {"enabled": True}, "steps_per_print": 1000,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    state = engine._zero3_consolidated_16bit_state_dict()
    with zkit.zero.GatheredParameters(list(engine.module.parameters())):
        expected = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"state": state, "expected": expected}
