"""The built-in optimizers: torch's own for adam/adamw/sgd, zkit's LAMB against a float64 reference."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.optim.plugin import zkit_register_optimizers
from zkit.optim import Lamb

RECORDS = {r.name: r for r in zkit_register_optimizers()}


def tiny_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=gen, dtype=next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def build(name: str, model: torch.nn.Module, **params):
    return RECORDS[name].factory([{"params": list(model.parameters())}], **params)


# --- records ---------------------------------------------------------------------------------------

def test_records():
    assert sorted(RECORDS) == ["adam", "adamw", "lamb", "sgd"]
    assert RECORDS["lamb"].elementwise is False
    assert all(RECORDS[n].elementwise for n in ("adam", "adamw", "sgd"))
    assert RECORDS["sgd"].state_names == ("momentum_buffer",)
    assert RECORDS["lamb"].state_names == ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("name,params", [
    ("adam", {}), ("adam", {"amsgrad": True}), ("adamw", {"weight_decay": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}), ("lamb", {"weight_decay": 0.01}),
])
def test_every_record_builds_steps_and_declares_its_state(name, params):
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build(name, model, **params)
    train(model, opt)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for p in model.parameters():
        shaped = {k for k, v in opt.state[p].items() if torch.is_tensor(v) and v.shape == p.shape}
        assert shaped and shaped <= set(RECORDS[name].state_names), shaped


# --- adam / adamw / sgd are torch's, bit for bit ----------------------------------------------------

@pytest.mark.parametrize("name,params,torch_cls,torch_params", [
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    ("adam", dict(lr=0.01, weight_decay=0.1), torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    ("adam", dict(lr=0.01, weight_decay=0.1, adam_w_mode=False), torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    ("adam", dict(betas=[0.8, 0.99], eps=1e-6, amsgrad=True, torch_adam=True), torch.optim.AdamW,
     dict(betas=(0.8, 0.99), eps=1e-6, amsgrad=True, weight_decay=0.0)),
    # DeepSpeed's AdamW default weight decay is 0, not torch's 0.01.
    ("adamw", dict(lr=0.02), torch.optim.AdamW, dict(lr=0.02, weight_decay=0.0)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3), torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("sgd", dict(lr=0.1, momentum=0.5, dampening=0.1), torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.1)),
])
def test_matches_torch_bit_for_bit(name, params, torch_cls, torch_params):
    ours_model, ref_model = tiny_model(), tiny_model()
    ours = build(name, ours_model, **params)
    ref = torch_cls(ref_model.parameters(), fused=True, **torch_params)
    assert type(ours) is torch_cls and ours.defaults["fused"] is True
    train(ours_model, ours)
    train(ref_model, ref)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_fused_unless_a_parameter_has_no_fused_kernel_and_explicit_choice_wins():
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = RECORDS["adamw"].factory([{"params": [complex_param]}])
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    model = tiny_model()
    opt = build("adamw", model, fused=False)
    assert opt.defaults["fused"] is False
    opt = build("sgd", model, foreach=True)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_half_precision_parameters_use_the_fused_kernel():
    model = tiny_model(dtype=torch.bfloat16)
    opt = build("adamw", model, lr=0.01)
    assert opt.defaults["fused"] is True
    train(model, opt, steps=2)


# --- parameter errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,message", [
    ("adam", {"lrr": 0.1}, "unknown parameter 'lrr' for optimizer 'adam'; did you mean 'lr'? valid: adam_w_mode, "
     "amsgrad, betas, bias_correction, eps, foreach, fused, lr, maximize, torch_adam, weight_decay"),
    ("sgd", {"momentun": 0.9}, "unknown parameter 'momentun' for optimizer 'sgd'; did you mean 'momentum'?"),
    ("lamb", {"max_coef": 5}, "unknown parameter 'max_coef' for optimizer 'lamb'; did you mean 'max_coeff'?"),
    ("adamw", {"zzz": 1}, "unknown parameter 'zzz' for optimizer 'adamw' valid: adam_w_mode,"),
    ("adam", {"lr": -0.1}, "optimizer 'adam': lr must be >= 0, got -0.1"),
    ("adam", {"lr": "0.1"}, "optimizer 'adam': lr must be a finite number, got '0.1'"),
    ("adam", {"betas": [0.9, 1.0]}, "optimizer 'adam': betas[1] must be < 1, got 1.0"),
    ("adamw", {"betas": [-0.1, 0.9]}, "optimizer 'adamw': betas[0] must be >= 0, got -0.1"),
    ("adam", {"betas": [0.9]}, "optimizer 'adam': betas must be a list of two numbers in [0, 1), got [0.9]"),
    ("adam", {"eps": -1e-8}, "optimizer 'adam': eps must be >= 0, got -1e-08"),
    ("adam", {"amsgrad": 1}, "optimizer 'adam': amsgrad must be true or false, got 1"),
    ("adamw", {"adam_w_mode": False}, "optimizer 'adamw': adam_w_mode=false contradicts AdamW"),
    ("adam", {"bias_correction": False}, "optimizer 'adam': bias_correction=false is not supported"),
    ("adam", {"fused": True, "foreach": True}, "optimizer 'adam': fused and foreach cannot both be true"),
    ("sgd", {"weight_decay": -1}, "optimizer 'sgd': weight_decay must be >= 0, got -1"),
    ("sgd", {"nesterov": True}, "optimizer 'sgd': nesterov=true needs momentum > 0 and dampening = 0"),
    ("lamb", {"amsgrad": True}, "optimizer 'lamb': amsgrad=True is not supported; LAMB has no AMSGrad variant"),
    ("lamb", {"min_coeff": 2.0, "max_coeff": 1.0}, "optimizer 'lamb': min_coeff (2.0) must not exceed max_coeff (1.0)"),
    ("lamb", {"max_coeff": 0}, "optimizer 'lamb': max_coeff must be > 0, got 0.0"),
    ("lamb", {"betas": (0.9, 1.5)}, "optimizer 'lamb': betas[1] must be < 1, got 1.5"),
    ("lamb", {"max_grad_norm": float("inf")}, "optimizer 'lamb': max_grad_norm must be a finite number, got inf"),
])
def test_bad_params_are_named(name, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(name, tiny_model(), **params)


# --- LAMB against a plain float64 reference ----------------------------------------------------------

def reference_lamb(params, grads_per_step, *, lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt,
                   max_coeff, min_coeff, max_grad_norm):
    """LAMB written out one parameter at a time, in float64, from the formulas."""
    b1, b2 = betas
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    coeffs = []
    for t, grads in enumerate(grads_per_step, start=1):
        grads = [g.double() for g in grads]
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
            clip = (norm + 1e-6) / max_grad_norm
            if clip > 1:
                grads = [g / clip for g in grads]
        coeffs = []
        for i, (p, g) in enumerate(zip(params, grads)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2**t) if bias_correction else v[i]
            denom = (v_hat + eps).sqrt() if eps_inside_sqrt else v_hat.sqrt() + eps
            update = m_hat / denom + weight_decay * p
            w_norm, u_norm = float(p.norm()), float(update.norm())
            ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            coeffs.append(ratio)
            params[i] = p - lr * ratio * update
    return params, coeffs


def lamb_case(seed: int, dtype, steps: int, shapes=((3, 4), (4,), (2, 2, 3))):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]
    return params, grads


def run_lamb(params, grads_per_step, **hp):
    opt = Lamb(params, **hp)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


HYPER = dict(
    lr=st.floats(1e-4, 1.0),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.0, 0.9999),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.5]),
    bias_correction=st.booleans(),
    eps_inside_sqrt=st.booleans(),
    coeffs=st.tuples(st.floats(0.001, 1.0), st.floats(1.0, 20.0)),
    max_grad_norm=st.sampled_from([0.0, 0.5, 100.0]),
    fused=st.sampled_from([None, False]),  # None: torch's fused Adam kernel wherever it applies
    seed=st.integers(0, 2**16),
)


@settings(max_examples=40, deadline=None)
@given(**HYPER)
def test_lamb_matches_reference_float64(lr, beta1, beta2, eps, weight_decay, bias_correction, eps_inside_sqrt,
                                        coeffs, max_grad_norm, fused, seed):
    hp = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
              eps_inside_sqrt=eps_inside_sqrt, min_coeff=coeffs[0], max_coeff=coeffs[1], max_grad_norm=max_grad_norm)
    params, grads = lamb_case(seed, torch.float64, steps=4)
    expected, expected_coeffs = reference_lamb(params, grads, **hp)
    opt = run_lamb(params, grads, fused=fused, **hp)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)
    assert opt.get_lamb_coeffs() == pytest.approx(expected_coeffs, rel=1e-6)


def test_lamb_fused_and_foreach_paths_agree_and_fused_needs_its_settings():
    params, grads = lamb_case(5, torch.float32, steps=4)
    other = [copy.deepcopy(p) for p in params]
    run_lamb(params, grads, lr=0.01, weight_decay=0.1, fused=True)
    run_lamb(other, grads, lr=0.01, weight_decay=0.1, fused=False)
    for a, b in zip(params, other):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=re.escape(
            "optimizer 'lamb': fused=True needs bias_correction=True and eps_inside_sqrt=False")):
        Lamb(params, fused=True, eps_inside_sqrt=True)


def test_lamb_float32_tracks_the_float64_reference():
    hp = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=True,
              eps_inside_sqrt=False, min_coeff=0.01, max_coeff=10.0, max_grad_norm=0.0)
    params, grads = lamb_case(7, torch.float32, steps=5)
    expected, _ = reference_lamb(params, grads, **hp)
    run_lamb(params, grads, **hp)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_lamb_zero_parameter_gets_unit_trust_ratio_and_ratio_is_clamped():
    zero = torch.nn.Parameter(torch.zeros(4))
    big = torch.nn.Parameter(torch.full((4,), 1e3))
    opt = Lamb([zero, big], lr=0.1, max_coeff=5.0)
    zero.grad, big.grad = torch.ones(4), torch.ones(4)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0, 5.0]
    # Adam's first update is sign(g) (bias-corrected): a zero parameter moves by exactly lr.
    torch.testing.assert_close(zero.detach(), torch.full((4,), -0.1))


def test_lamb_grad_norms_override_drives_clipping():
    params, grads = lamb_case(3, torch.float64, steps=1)
    hp = dict(lr=0.1, max_grad_norm=1.0)
    local = run_lamb([copy.deepcopy(p) for p in params], grads, **hp)
    forced = Lamb([copy.deepcopy(p) for p in params], **hp)
    for p, g in zip(forced.param_groups[0]["params"], grads[0]):
        p.grad = g.clone()
    # A global norm of 1000 clips the same gradients much harder than their local norm does.
    forced.step(grad_norms=[1000.0])
    m_local = local.state[local.param_groups[0]["params"][0]]["exp_avg"]
    m_forced = forced.state[forced.param_groups[0]["params"][0]]["exp_avg"]
    local_norm = math.sqrt(sum(float(g.square().sum()) for g in grads[0]))
    torch.testing.assert_close(m_forced * (1000.0 + 1e-6), m_local * (local_norm + 1e-6))
    with pytest.raises(ValueError, match=re.escape("optimizer 'lamb': grad_norms has 2 entries for 1 param groups")):
        forced.step(grad_norms=[1.0, 2.0])


def test_lamb_state_dict_round_trip_continues_identically():
    params, grads = lamb_case(11, torch.float32, steps=5)
    straight = [copy.deepcopy(p) for p in params]
    run_lamb(straight, grads, lr=0.02, weight_decay=0.01)

    first = Lamb(params, lr=0.02, weight_decay=0.01)
    for step_grads in grads[:2]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        first.step()
    saved = copy.deepcopy(first.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Lamb(resumed_params, lr=0.02, weight_decay=0.01)
    resumed.load_state_dict(saved)
    for step_grads in grads[2:]:
        for p, g in zip(resumed_params, step_grads):
            p.grad = g.clone()
        resumed.step()
    for a, b in zip(resumed_params, straight):
        assert torch.equal(a, b)


def test_lamb_mixed_dtypes_in_one_group_and_params_without_grad():
    a = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    idle = torch.nn.Parameter(torch.randn(3))
    opt = Lamb([a, b, idle], lr=0.1)
    a.grad, b.grad = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    assert len(opt.get_lamb_coeffs()) == 2 and idle not in opt.state
    assert opt.state[b]["exp_avg"].dtype == torch.bfloat16


def test_lamb_refuses_sparse_gradients():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = Lamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=re.escape("optimizer 'lamb' does not support sparse gradients")):
        opt.step()


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_empty_parameter_and_per_group_lr(name):
    # A rank that owns no elements still builds and steps an optimizer over a 0-element parameter.
    empty, ones = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(3))
    opt = RECORDS[name].factory([{"params": [empty]}, {"params": [ones], "lr": 0.5}], lr=0.1)
    empty.grad, ones.grad = torch.zeros(0), torch.ones(3)
    opt.step()
    # First step of every optimizer here moves each element by exactly the group's lr:
    # Adam's and LAMB's bias-corrected direction is sign(g) (LAMB's trust ratio is 1 for p = u),
    # and SGD's is g = 1.
    torch.testing.assert_close(ones.detach(), torch.full((3,), 0.5), rtol=0, atol=1e-6)
