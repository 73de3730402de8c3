"""FusedAdamCUDA as zkit's FusedStepOptimizer, run by the CUDA simulator: the gradient factor is
applied in the kernel, the inf/NaN check skips a step, ZeRO's master views are stepped where they
are, state assigned from outside (a checkpoint loader) is stepped, and 16-bit twins are written.
Sizes stay tiny: the simulator runs every CUDA thread as a Python thread."""
from __future__ import annotations

import pytest
import torch

from zkit.optim.fused_step import FusedStepOptimizer
from zkit_cuda_numba import runtime
from zkit_cuda_numba.fused_adam import FusedAdamCUDA

pytestmark = pytest.mark.usefixtures("sim")


def _values(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((7, 5), (300,))]


def _leaves(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.clone().requires_grad_() for v in values]


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def test_fused_step_multiplies_each_gradient_by_the_factor_in_the_kernel():
    ours, ref = _leaves(_values()), _leaves(_values())
    opt = FusedAdamCUDA(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, FusedStepOptimizer) and opt.fuses and opt.last_kernel == "no step yet"
    for step, factor in enumerate((0.25, 1.0, 1 / 1024)):
        grads = _grads(ours, step)
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g * factor
        assert opt.fused_step(grad_factor=factor) is True
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
    assert opt.step_count == 3 and float(opt.state[ours[0]]["step"]) == 3.0
    assert "adam_step" in opt.last_kernel and "gradient x 0.000976562" in opt.last_kernel


def test_check_overflow_skips_an_inf_gradient_and_changes_nothing():
    ours = _leaves(_values())
    opt = FusedAdamCUDA(ours, lr=1e-2)
    for p, g in zip(ours, _grads(ours, 0)):
        p.grad = g
    assert opt.fused_step(grad_factor=0.5, check_overflow=True) is True
    before = [t.clone() for t in (opt.master, opt.exp_avg, opt.exp_avg_sq)]
    ours[1].grad[17] = float("inf")
    assert opt.fused_step(grad_factor=0.5, check_overflow=True) is False
    assert all(torch.equal(a, b) for a, b in zip(before, (opt.master, opt.exp_avg, opt.exp_avg_sq)))
    assert opt.step_count == 1 and "inf/NaN check fused" in opt.last_kernel
    ours[1].grad[17] = 0.0
    assert opt.fused_step(check_overflow=True) is True and opt.step_count == 2


def _zero_like_layout():
    """What the ZeRO partitioner hands an optimizer: parameters that are views of two unit
    buffers (fp32 master shards), with padding after the pieces, in two interleaved groups, and
    gradients that are views of gradient buffers laid out alike. The padding holds inf."""
    gen = torch.Generator().manual_seed(5)
    units, grad_units = [torch.randn(64, generator=gen), torch.randn(40, generator=gen)], []
    for u in units:
        g = torch.randn(u.numel(), generator=gen)
        g[-3:] = float("inf")
        grad_units.append(g)
    units[0][50:] = float("inf")
    ranges = [(0, 0, 20), (0, 20, 50), (1, 0, 33)]
    params = [torch.nn.Parameter(units[u][a:b]) for u, a, b in ranges]
    grads = [grad_units[u][a:b] for u, a, b in ranges]
    return units, params, grads


def test_in_place_steps_zero_master_views_where_they_are():
    units, params, grads = _zero_like_layout()
    ref = [p.detach().clone().requires_grad_() for p in params]
    groups = lambda ps: [{"params": [ps[0], ps[2]]}, {"params": [ps[1]], "lr": 3e-2}]  # noqa: E731
    opt = FusedAdamCUDA(groups(params), lr=1e-2, weight_decay=0.1, in_place=True)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    padding = [units[0][50:].clone(), units[1][33:].clone()]
    pointers = [p.data_ptr() for p in params]
    assert len(opt.buffers) == 2
    for _ in range(2):
        for p, q, g in zip(params, ref, grads):
            p.grad, q.grad = g, g * 0.5
        assert opt.fused_step(grad_factor=0.5, check_overflow=True) is True  # the padding's inf is not read
        ref_opt.step()
    assert [p.data_ptr() for p in params] == pointers  # nothing moved: the units hold the update
    torch.testing.assert_close(units[0][:50], torch.cat([ref[0].detach(), ref[1].detach()]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(units[1][:33], ref[2].detach(), atol=1e-6, rtol=1e-5)
    assert torch.equal(units[0][50:], padding[0]) and torch.equal(units[1][33:], padding[1])
    assert all(not buf.grads.any() for buf in opt.buffers)  # the gradients were read in place
    with pytest.raises(ValueError, match="steps 2 flat buffers"):
        opt.master  # noqa: B018


def test_default_layout_steps_an_existing_flat_buffer_without_copying():
    flat = torch.randn(50, generator=torch.Generator().manual_seed(6))
    params = [torch.nn.Parameter(flat[:35].view(7, 5)), torch.nn.Parameter(flat[35:])]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = FusedAdamCUDA(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    assert opt.flat_params.data_ptr() == flat.data_ptr()
    for p, q, g in zip(params, ref, _grads(params, 1)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(flat, torch.cat([q.detach().reshape(-1) for q in ref]), atol=1e-6, rtol=1e-5)


def test_state_assigned_by_a_checkpoint_loader_is_what_the_next_step_uses():
    """zkit's loader assigns ``optimizer.state[piece] = {...}`` (here: torch AdamW's state after
    two steps) instead of calling load_state_dict."""
    ref = _leaves(_values())
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for seed in (0, 1):
        for q, g in zip(ref, _grads(ref, seed)):
            q.grad = g
        ref_opt.step()
    units = [torch.zeros(40), torch.zeros(300)]
    params = [torch.nn.Parameter(units[0][:35].view(7, 5)), torch.nn.Parameter(units[1])]
    with torch.no_grad():
        for p, q in zip(params, ref):
            p.copy_(q)
    opt = FusedAdamCUDA(params, lr=1e-2, weight_decay=0.1, in_place=True)
    for p, q in zip(params, ref):
        opt.state[p] = {k: v.clone() for k, v in ref_opt.state[q].items()}
    grads = _grads(ref, 2)
    for p, q, g in zip(params, ref, grads):
        p.grad, q.grad = g.clone(), g
    assert opt.fused_step() is True
    ref_opt.step()
    assert opt.step_count == 3
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
    views = {buf.exp_avg.data_ptr() for buf in opt.buffers}
    assert opt.state[params[0]]["exp_avg"].data_ptr() in views  # state entries are views again


def test_load_state_dict_keeps_the_fp32_moments_of_16_bit_parameters():
    params = [v.half().requires_grad_() for v in _values()]
    opt = FusedAdamCUDA(params)
    sd = opt.state_dict()
    tiny = torch.full((300,), 1e-9)  # below fp16's smallest subnormal
    sd["state"][1] = {"exp_avg": tiny, "exp_avg_sq": tiny * 1e-3, "step": torch.tensor(4.0)}
    sd["state"][0] = {**sd["state"][0], "step": torch.tensor(4.0)}
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[params[1]]["exp_avg_sq"], tiny * 1e-3) and opt.step_count == 4


def test_attach_copy_out_writes_16_bit_twins_after_the_update():
    units, params, grads = _zero_like_layout()
    opt = FusedAdamCUDA(params, lr=1e-2, in_place=True)
    twins = [torch.zeros(p.shape, dtype=torch.float16) for p in params]
    for p, twin in zip(params, twins):
        opt.attach_copy_out(p, twin)
    opt.attach_copy_out(params[2], None)  # detached: left alone
    for p, g in zip(params, grads):
        p.grad = g
    opt.fused_step(grad_factor=0.5)
    assert torch.equal(twins[0], params[0].detach().half()) and torch.equal(twins[1], params[1].detach().half())
    assert not twins[2].any() and "float16 copy-out" in opt.last_kernel
    with pytest.raises(TypeError, match="must be torch.float16 or torch.bfloat16"):
        opt.attach_copy_out(params[0], torch.zeros(20))
    with pytest.raises(ValueError, match="the target has 19 elements, the parameter 20"):
        opt.attach_copy_out(params[0], torch.zeros(19, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not one this optimizer steps"):
        opt.attach_copy_out(torch.nn.Parameter(torch.zeros(3)), None)


def test_a_rank_owning_nothing_steps_nothing():
    empty = torch.nn.Parameter(torch.zeros(0))
    opt = FusedAdamCUDA([empty], in_place=True)
    assert opt.buffers == [] and opt.fused_step(grad_factor=0.5, check_overflow=True) is True
    assert opt.state[empty]["exp_avg"].shape == (0,)


def test_refusals_name_the_cause(monkeypatch):
    flat = torch.zeros(10)
    with pytest.raises(ValueError, match="must be contiguous and must not overlap"):
        FusedAdamCUDA([torch.nn.Parameter(flat[:6]), torch.nn.Parameter(flat[4:])], in_place=True)
    opt = FusedAdamCUDA(_leaves(_values()))
    with pytest.raises(ValueError, match="build a new optimizer to add a parameter group"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    monkeypatch.setattr(runtime, "simulator_enabled", lambda: False)
    with pytest.raises(ValueError, match="steps tensors on a CUDA device; its parameters are on cpu"):
        FusedAdamCUDA(_leaves(_values()))
