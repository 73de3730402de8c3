"""Loaded optimizer state goes where torch's load_state_dict would put it
(``zkit.checkpoint.optim_state``): the step count on the parameter's device, as fp32, where a fused
or capturable kernel reads it there. On a GPU torch's fused Adam refused a resumed run's first step
("state_steps is on cpu"); the ``meta`` device stands in for it here."""
from __future__ import annotations

import torch

import zkit
from zkit.checkpoint.optim_state import StatePlacer


def _optimizer(**flags) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    param = torch.nn.Parameter(torch.empty(2, 3, device="meta"))
    return torch.optim.AdamW([{"params": [param], **flags}], lr=1e-3), param


def test_the_step_count_follows_a_fused_or_capturable_kernel_to_the_parameters_device():
    saved = {"step": torch.tensor(7.0, dtype=torch.float64), "exp_avg": torch.zeros(6), "exp_avg_sq": torch.ones(6)}
    for flags in ({"fused": True}, {"capturable": True}):
        opt, param = _optimizer(**flags)
        placed = StatePlacer(opt).place(param, saved)
        assert placed["step"].device.type == "meta" and placed["step"].dtype == torch.float32
        assert all(placed[k].device.type == "meta" and placed[k].shape == (2, 3) for k in ("exp_avg", "exp_avg_sq"))


def test_the_step_count_stays_as_saved_for_a_kernel_that_reads_it_on_the_host():
    opt, param = _optimizer(fused=False, foreach=False)
    step = torch.tensor(7.0)
    placed = StatePlacer(opt).place(param, {"step": step, "exp_avg": torch.zeros(6), "note": "kept"})
    assert placed["step"] is step
    assert placed["exp_avg"].device.type == "meta" and placed["note"] == "kept"


def test_a_resumed_fused_adam_keeps_its_step_count_where_the_parameters_are(tmp_path):
    def engine():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 1}}
        return zkit.initialize(model=model, config=cfg)[0]

    first = engine()
    first.backward(first(torch.ones(2, 4)).sum())
    first.step()
    first.save_checkpoint(str(tmp_path), tag="t")
    resumed = engine()
    resumed.load_checkpoint(str(tmp_path), tag="t")
    for group in resumed.optimizer.param_groups:
        assert group["fused"]
        for p in group["params"]:
            step = resumed.optimizer.state[p]["step"]
            assert step.device == p.device and step.dtype == torch.float32 and float(step) == 1.0
    resumed.backward(resumed(torch.ones(2, 4)).sum())
    resumed.step()
    first.close()
    resumed.close()
