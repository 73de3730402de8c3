"""What the engine owns and hands out through public interfaces: its training state
(``train_state_dict``), the plugins' per-engine stash, and the hooks around the step."""
import pytest
import torch

import zkit
from zkit.core.stash import Stash, StashKey

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "fp16": {"enabled": True, "initial_scale_power": 6},
}


def _engine(config=CONFIG, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, *_ = zkit.initialize(model=model, config=config, **kw)
    return engine


def _train(engine, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(2, 4, generator=g).to(next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()


def test_stash_is_typed_and_per_object():
    key, other = StashKey[int](), StashKey[str]()
    a, b = Stash(), Stash()
    a[key] = 3
    assert a[key] == 3 and key in a and other not in a and len(a) == 1
    assert b.get(key, None) is None  # per object
    assert a.setdefault(other, "x") == "x" and a[other] == "x"
    del a[key]
    with pytest.raises(KeyError):
        a[key]


def test_train_state_round_trips_counters_and_loss_scale():
    engine = _engine()
    _train(engine, 3)
    state = engine.train_state_dict()
    assert state["global_steps"] == 3 and state["micro_steps"] == 6 and state["global_samples"] == 12
    assert state["loss_scaler"]["scale"] == engine.loss_scale
    fresh = _engine()
    fresh.load_train_state_dict(state)
    assert fresh.train_state_dict() == state
    # the module's state_dict is untouched: DeepSpeed's engine.state_dict() is the module's too
    assert set(fresh.state_dict()) == {f"module.{k}" for k in fresh.module.state_dict()}
    with pytest.raises(KeyError, match="the state has no global_steps, micro_steps"):
        fresh.load_train_state_dict({"global_samples": 0, "skipped_steps": 0, "loss_scaler": {}})
    engine.close()
    fresh.close()
