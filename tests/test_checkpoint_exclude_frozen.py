"""``save_checkpoint(..., exclude_frozen_parameters=True)``: DeepSpeed's argument. Frozen
parameters are left out of the checkpoint's module state (a fine-tune's frozen base is not saved
again with every checkpoint); loading it keeps the model's own frozen values, and a consolidation
has no entry for them."""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.checkpoint import consolidate
from zkit.checkpoint.files import load_rank_file, read_meta


class FrozenBase(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 1)
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.base(x))) * self.scale, y)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=g)
    return x, x.sum(1, keepdim=True) * 0.1


def _engine(stage: int):
    model = FrozenBase()
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zkit.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                 config=config)
    return engine


def _step(engine, step: int) -> float:
    loss = engine(*_batch(step))
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_frozen_parameters_left_out_and_training_resumes_the_same(tmp_path, stage):
    engine = _engine(stage)
    _step(engine, 0)
    # DeepSpeed's positional order: save_dir, tag, client_state, save_latest, exclude_frozen_parameters
    engine.save_checkpoint(str(tmp_path / "lean"), "t", {}, True, True)
    engine.save_checkpoint(str(tmp_path / "full"), tag="t")
    lean, full = load_rank_file(tmp_path / "lean" / "t" / "rank_00000.pt"), load_rank_file(tmp_path / "full" / "t" / "rank_00000.pt")
    assert sorted(full["module_extras"]) == ["base.bias", "base.weight", "scale"]
    assert sorted(lean["module_extras"]) == ["scale"]
    assert "base.weight" not in read_meta(tmp_path / "lean" / "t")["state_dict_keys"]

    out = consolidate(tmp_path / "lean", tmp_path / "lean.pt")
    assert sorted(torch.load(out, weights_only=True)) == ["head.bias", "head.weight", "scale"]

    expected = [_step(engine, s) for s in (1, 2)]
    for saved in ("lean", "full"):
        again = _engine(stage)
        again.load_checkpoint(str(tmp_path / saved), tag="t")
        assert [_step(again, s) for s in (1, 2)] == expected, saved
