"""1-bit Adam on one process: warm-up is AdamW bit for bit in every dtype; the compressed phase
is Adam with the variance (and its bias correction) frozen."""
from __future__ import annotations

import pytest
import torch

from zkit_onebit.adam import OneBitAdam


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in [(7, 3), (5,), (2, 2, 2)]]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


@pytest.mark.parametrize(
    "dtype,foreach",
    # torch's foreach kernels round fp16/bf16 differently from its for-loop; fp32 agrees.
    [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.float32, True)],
)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_warmup_equals_adamw_bit_for_bit(dtype, weight_decay, foreach):
    ours, ref = _params(dtype), _params(dtype)
    opt = OneBitAdam(ours, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, freeze_step=6)
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, foreach=foreach)
    for step in range(6):
        for p, q, g in zip(ours, ref, _grads(ours, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q), f"step {step}"
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
    assert opt.frozen


def test_compressed_phase_single_rank_freezes_variance_and_its_bias_correction():
    params = _params(torch.float32)
    opt = OneBitAdam(params, lr=1e-2, freeze_step=3)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    grads = _grads(params, 3)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    for p, v, x0, m0, g in zip(params, frozen, before, moments, grads):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        m = m0.lerp(g, 0.1)
        expected = x0 - 1e-2 / (1 - 0.9**4) * m / (v.sqrt() / (1 - 0.999**3) ** 0.5 + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_without_bias_correction_is_deepspeeds_update():
    (p,) = [torch.nn.Parameter(torch.tensor([1.0, -2.0]))]
    opt = OneBitAdam([p], lr=0.1, freeze_step=10, bias_correction=False, weight_decay=0.5)
    p.grad = torch.tensor([0.5, 0.25])
    opt.step()
    m = 0.1 * torch.tensor([0.5, 0.25])
    v = 0.001 * torch.tensor([0.5, 0.25]) ** 2
    x0 = torch.tensor([1.0, -2.0])
    # DeepSpeed: update = m / (sqrt(v) + eps) + wd * p; p -= lr * update
    torch.testing.assert_close(p.detach(), x0 - 0.1 * (m / (v.sqrt() + 1e-8) + 0.5 * x0))


def test_eps_inside_sqrt():
    (p,) = [torch.nn.Parameter(torch.tensor([1.0]))]
    opt = OneBitAdam([p], lr=0.1, freeze_step=10, bias_correction=False, eps=1e-2, eps_inside_sqrt=True)
    p.grad = torch.tensor([0.5])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0]) - 0.1 * 0.05 / (0.001 * 0.25 + 1e-2) ** 0.5)


def test_elements_without_warmup_gradient_stay_put_after_the_freeze():
    """v = 0 at the freeze (no gradient in warm-up): Adam's denominator would be eps, and a later
    gradient would move the element by m / eps. It stays put (weight decay aside)."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = OneBitAdam([p], lr=0.1, freeze_step=2)
    for _ in range(2):
        p.grad = torch.tensor([0.5, 0.0, -0.5])
        opt.step()
    frozen = p.detach().clone()
    for _ in range(3):
        p.grad = torch.tensor([0.5, 4.0, -0.5])
        opt.step()
    assert p[1].item() == frozen[1].item() == 2.0
    assert torch.all(torch.isfinite(opt.state[p]["exp_avg"])) and opt.state[p]["exp_avg"][1] == 0
    assert p[0] < frozen[0] and p[2] > frozen[2]
