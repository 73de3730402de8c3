"""Rank functions for the config-key tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import logging

import torch

import zkit


def fp16_sum_overflow(prescale: bool) -> dict:
    """Each rank's gradient is 40000: their fp16 sum (80000) overflows, the pre-divided one does not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-9}},
           "fp16": {"enabled": True, "loss_scale": 1.0}, "prescale_gradients": prescale, "steps_per_print": 1000}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    loss = (engine(torch.ones(1, 1, dtype=torch.float16)) * 0 + engine.module.weight * 40000.0).sum()
    engine.backward(loss)
    engine.step()
    applied = engine.was_step_applied()
    engine.close()
    return {"applied": applied}


def predivide_runs(runs: list[tuple[int, float]]) -> list[list[float]]:
    """:func:`predivide_matches_average` for each ``(stage, factor)``, in one launch of the ranks."""
    return [predivide_matches_average(stage, factor) for stage, factor in runs]


def predivide_matches_average(stage: int, factor: float) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}, "gradient_predivide_factor": factor, "steps_per_print": 1000}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(engine.rank)
    for _ in range(2):
        loss = engine(torch.randn(2, 4, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    out = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).tolist()
    engine.close()
    return out


def tags_differ(mode: str, root: str) -> str:
    engine, *_ = zkit.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"tag_validation": mode}, "steps_per_print": 1000})
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("zkit").addHandler(handler)
    try:
        engine.save_checkpoint(root, tag=f"t{engine.rank}")
        outcome = "saved"
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        outcome = f"{type(exc).__name__}: {exc}"
    engine.close()
    return outcome + " | " + " ".join(records)


def save_16bit_stage3(path: str, gather: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "bf16": {"enabled": True}, "steps_per_print": 1000,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_gather_16bit_weights_on_model_save": gather}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    loss = engine(torch.ones(1, 8, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
    saved = engine.save_16bit_model(path, "model.bin")
    with zkit.zero.GatheredParameters(list(engine.module.parameters())):
        expected = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"saved": saved, "expected": expected}
