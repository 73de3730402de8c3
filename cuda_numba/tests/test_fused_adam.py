"""FusedAdamCUDA, run by the CUDA simulator, equals torch.optim.Adam/AdamW."""
from __future__ import annotations

import pytest
import torch

from zkit_cuda_numba.fused_adam import FusedAdamCUDA

pytestmark = pytest.mark.usefixtures("sim")


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in ((7, 5), (300,))]


@pytest.mark.parametrize("adamw", [True, False])
def test_matches_torch_over_steps_and_groups(adamw):
    ours, ref = _params(), _params()
    groups = lambda ps: [{"params": [ps[0]], "lr": 1e-2}, {"params": [ps[1]], "weight_decay": 0.0}]  # noqa: E731
    opt = FusedAdamCUDA(groups(ours), lr=3e-3, weight_decay=0.1, adam_w_mode=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls(groups(ref), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        assert opt.step() is True
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(opt.state[ours[1]]["exp_avg"], ref_opt.state[ref[1]]["exp_avg"])


def test_fp16_params_fp32_master_unscale_and_inf_skip():
    ours = _params(torch.float16)
    ref = [p.detach().float().requires_grad_() for p in ours]
    opt = FusedAdamCUDA(ours, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    assert opt.master.dtype == torch.float32
    grads = [torch.randn(p.shape) for p in ours]
    for p, q, g in zip(ours, ref, grads):
        p.grad, q.grad = (g * 128).half(), g
    assert opt.step(grad_scale=128.0)
    ref_opt.step()
    torch.testing.assert_close(opt.master[: 35].view(7, 5), ref[0].detach(), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(ours[0].detach().float(), ref[0].detach(), atol=2e-3, rtol=2e-3)

    before = opt.master.clone()
    ours[1].grad[3] = float("inf")
    assert opt.step(grad_scale=128.0) is False
    assert torch.equal(opt.master, before) and opt.step_count == 1


def test_zero_grad_keeps_flat_views_and_errors():
    ps = _params()
    opt = FusedAdamCUDA(ps)
    opt.zero_grad()
    assert ps[0].grad.data_ptr() == opt.flat_grads.data_ptr()
    opt.zero_grad(set_to_none=True)
    assert ps[0].grad is None
    with pytest.raises(ValueError, match="does not implement amsgrad"):
        FusedAdamCUDA(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="one device with one dtype"):
        FusedAdamCUDA([torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.float16, requires_grad=True)])
    with pytest.raises(ValueError, match="invalid Adam hyper-parameters"):
        FusedAdamCUDA(_params(), betas=(1.0, 0.9))


def test_plugin_registers_under_simulator_and_reports():
    from zkit_cuda_numba import plugin

    (record,) = list(plugin.zkit_register_optimizers())
    assert record.name == "fused_adam_cuda" and record.devices == ("cuda",)
    assert record.state_names == ("exp_avg", "exp_avg_sq") and record.saved_state_format == "adam"
    report = dict(plugin.zkit_report())
    assert "simulator" in report["zkit-cuda-numba"]
    assert report["zkit-cuda-numba fused Adam"].startswith("config type fused_adam_cuda on a cuda device steps with")


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone().to(p.dtype)
    opt.step()


def test_load_state_dict_restores_flat_views_and_step():
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(p.shape, generator=gen) for p in _params()] for _ in range(4)]
    ref = _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    ours = _params()
    opt = FusedAdamCUDA(ours, lr=1e-2, weight_decay=0.1)
    for g in grads[:2]:
        _step(opt, ours, g)
        _step(ref_opt, ref, g)
    saved = opt.state_dict()
    assert float(saved["state"][1]["step"]) == 2.0

    # A fresh optimizer over parameters holding the same values, then the checkpoint.
    resumed = [p.detach().clone().requires_grad_() for p in ours]
    opt2 = FusedAdamCUDA(resumed, lr=5.0, weight_decay=0.1)  # lr comes back from the checkpoint
    opt2.load_state_dict(saved)
    assert opt2.step_count == 2 and opt2.param_groups[0]["lr"] == 1e-2
    assert opt2.state[resumed[0]]["exp_avg"].data_ptr() == opt2.exp_avg.data_ptr()
    torch.testing.assert_close(opt2.exp_avg, opt.exp_avg)
    for g in grads[2:]:
        _step(opt2, resumed, g)
        _step(ref_opt, ref, g)
    for p, q in zip(resumed, ref):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)


def test_load_state_dict_from_torch_adamw_and_errors():
    gen = torch.Generator().manual_seed(3)
    ref = _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    _step(ref_opt, ref, [torch.randn(p.shape, generator=gen) for p in ref])
    ours = [p.detach().clone().requires_grad_() for p in ref]
    opt = FusedAdamCUDA(ours, lr=1e-2)
    opt.load_state_dict(ref_opt.state_dict())
    g = [torch.randn(p.shape, generator=gen) for p in ref]
    _step(opt, ours, g)
    _step(ref_opt, ref, g)
    torch.testing.assert_close(ours[1].detach(), ref[1].detach(), atol=1e-6, rtol=1e-5)

    bad = ref_opt.state_dict()
    bad["state"][1] = {**bad["state"][1], "step": torch.tensor(7.0)}
    with pytest.raises(ValueError, match="different step counts"):
        FusedAdamCUDA(_params()).load_state_dict(bad)
    bad["state"][1] = {"exp_avg": bad["state"][1]["exp_avg"], "step": torch.tensor(1.0)}
    with pytest.raises(ValueError, match="parameter 1 has no 'exp_avg_sq'"):
        FusedAdamCUDA(_params()).load_state_dict(bad)
