"""The fused CPU optimizers against torch's (and a float64 reference for Lion)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_offload import CPUAdagrad, CPUAdam, CPUAdamW, CPULion

SIZES = st.sampled_from([0, 1, 2, 7, 33, 1000, 4099])
fast = settings(max_examples=12, deadline=None)


def twin(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    return p, torch.nn.Parameter(p.detach().clone()), g


def run(ours, theirs, p1, p2, gen, steps, grad_fn=None):
    for _ in range(steps):
        grad = torch.randn(p1.shape, generator=gen)
        p1.grad, p2.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()


@fast
@given(n=SIZES, lr=st.floats(1e-4, 1e-1), b1=st.floats(0.0, 0.99), b2=st.floats(0.9, 0.9999),
       wd=st.sampled_from([0.0, 0.01, 0.1]), eps=st.sampled_from([1e-8, 1e-6]), adamw=st.booleans())
def test_adam_matches_torch(n, lr, b1, b2, wd, eps, adamw):
    p1, p2, gen = twin(n)
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ours = (CPUAdamW if adamw else CPUAdam)([p1], backend="numba", **kw)  # the kernel, not torch's
    theirs = (torch.optim.AdamW if adamw else torch.optim.Adam)([p2], **kw)
    run(ours, theirs, p1, p2, gen, steps=25)
    torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-5 * max(lr * 25, 1e-3))
    torch.testing.assert_close(ours.state[p1]["exp_avg"], theirs.state[p2]["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.state[p1]["exp_avg_sq"], theirs.state[p2]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_adam_backends_agree_and_torch_backend_runs():
    p1, p2, gen = twin(513)
    a, b = CPUAdam([p1], lr=1e-2, backend="numba"), CPUAdam([p2], lr=1e-2, backend="torch")
    run(a, b, p1, p2, gen, steps=10)
    torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


@fast
@given(n=SIZES, lr=st.floats(1e-3, 1e-1), lr_decay=st.sampled_from([0.0, 0.01]),
       wd=st.sampled_from([0.0, 0.1]), init=st.sampled_from([0.0, 0.1]))
def test_adagrad_matches_torch(n, lr, lr_decay, wd, init):
    p1, p2, gen = twin(n)
    kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=init)
    ours, theirs = CPUAdagrad([p1], **kw), torch.optim.Adagrad([p2], **kw)
    run(ours, theirs, p1, p2, gen, steps=25)
    torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.state[p1]["sum"], theirs.state[p2]["sum"], rtol=1e-5, atol=1e-6)


def lion_reference(p, grads, lr, b1, b2, wd):
    p, m = p.astype(np.float64), np.zeros_like(p, dtype=np.float64)
    for g in grads:
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * np.sign(c)
        m = b2 * m + (1 - b2) * g
    return p, m


@fast
@given(n=SIZES, lr=st.floats(1e-4, 1e-2), b1=st.floats(0.8, 0.95), b2=st.floats(0.9, 0.999),
       wd=st.sampled_from([0.0, 0.1]))
def test_lion_matches_float64_reference(n, lr, b1, b2, wd):
    p, _, gen = twin(n)
    start = p.detach().numpy().copy()
    grads = [torch.randn(n, generator=gen) for _ in range(20)]
    opt = CPULion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    for g in grads:
        p.grad = g
        opt.step()
    ref_p, ref_m = lion_reference(start, [g.numpy() for g in grads], lr, b1, b2, wd)
    np.testing.assert_allclose(p.detach().numpy(), ref_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state[p]["exp_avg"].numpy(), ref_m, rtol=1e-5, atol=1e-6)


def test_grad_factor_unscales_like_pre_divided_gradients():
    p1, p2, gen = twin(1001)
    a, b = CPUAdam([p1], lr=1e-2, backend="numba"), CPUAdam([p2], lr=1e-2, backend="numba")
    for _ in range(5):
        g = torch.randn(1001, generator=gen)
        p1.grad, p2.grad = g * 1024.0, g.clone()
        assert a.fused_step(grad_factor=1 / 1024.0, check_overflow=True)
        b.step()
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)  # x*1024/1024 is exact in fp32


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_overflow_skips_and_leaves_everything_untouched(bad):
    p, _, gen = twin(777)
    opt = CPUAdam([p], lr=1e-2)
    p.grad = torch.randn(777, generator=gen)
    opt.step()
    before = [p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone(),
              opt.state[p]["step"].clone()]
    p.grad = torch.randn(777, generator=gen)
    p.grad[500] = bad
    assert opt.fused_step(grad_factor=0.5, check_overflow=True) is False
    assert opt.last_step_applied is False
    after = [p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"]]
    for x, y in zip(before, after):
        assert torch.equal(x, y)
    assert opt.grad_stats()[1] == 1
    p.grad[500] = 0.0
    opt.step(check_overflow=True)
    assert opt.last_step_applied and float(opt.state[p]["step"]) == 2


def test_grad_stats_is_the_squared_norm():
    p, _, gen = twin(12345)
    opt = CPUAdam([p])
    p.grad = torch.randn(12345, generator=gen)
    sumsq, bad = opt.grad_stats(grad_factor=0.25)
    assert bad == 0
    assert math.isclose(sumsq, float((p.grad.double() * 0.25).pow(2).sum()), rel_tol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [CPUAdam, CPUAdagrad, CPULion])
def test_copy_out_equals_torch_cast(dtype, cls):
    n = 4099
    p = torch.nn.Parameter(torch.randn(n) * 3e4)  # beyond fp16's range, and tiny values below
    with torch.no_grad():
        p[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-8, -6e-8, 65504.0, 65520.0, -0.0])
        p[8:100] *= 1e-9
    opt = cls([p], lr=1e-3)
    out = torch.empty(n, dtype=dtype)
    opt.attach_copy_out(p, out)
    p.grad = torch.randn(n)
    opt.step()
    expected = p.detach().to(dtype)
    nan = expected.isnan()
    # torch's own vectorised and scalar bf16 casts disagree on NaN bits; NaN must stay NaN
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_state_dict_moves_between_torch_adam_and_cpu_adam():
    p1, p2, gen = twin(300)
    theirs, ours = torch.optim.Adam([p2], lr=1e-2), CPUAdam([p1], lr=1e-2)
    run(ours, theirs, p1, p2, gen, steps=3)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # torch shares tensors otherwise
    with torch.no_grad():
        p1.copy_(p2)
    run(ours, theirs, p1, p2, gen, steps=3)
    torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)
    back = torch.optim.Adam([torch.nn.Parameter(p1.detach().clone())], lr=1e-2)
    back.load_state_dict(ours.state_dict())
    assert set(ours.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_lr_schedule_and_param_groups():
    a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
    opt = CPUAdam([{"params": [a]}, {"params": [b], "lr": 0.0}], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    for _ in range(3):
        a.grad, b.grad = torch.ones(10), torch.ones(10)
        opt.step()
        sched.step()
    assert torch.allclose(a.detach(), torch.full((10,), 0.9), atol=1e-6)  # only the first step moved it
    assert torch.equal(b.detach(), torch.ones(10))


@pytest.mark.parametrize("make, message", [
    (lambda: CPUAdam([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))]), "steps contiguous fp32 parameters on the CPU"),
    (lambda: CPUAdam([torch.nn.Parameter(torch.ones(3))], amsgrad=True), "does not support amsgrad=True"),
    (lambda: CPUAdam([torch.nn.Parameter(torch.ones(3))], lr=-1.0), "invalid learning rate -1.0"),
    (lambda: CPUAdam([torch.nn.Parameter(torch.ones(3))], betas=(0.9, 1.0)), "invalid betas (0.9, 1.0)"),
    (lambda: CPUAdam([torch.nn.Parameter(torch.ones(3))], backend="cuda"), "backend must be one of auto, numba, torch"),
    (lambda: CPUAdagrad([torch.nn.Parameter(torch.ones(3))], eps=-1.0), "CPUAdagrad: invalid eps -1.0"),
    (lambda: CPULion([torch.nn.Parameter(torch.ones(3))], betas=(2.0, 0.9)), "CPULion: invalid betas (2.0, 0.9)"),
])
def test_bad_input_is_refused_with_a_clear_message(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_bad_gradient_and_copy_out_target_messages():
    p = torch.nn.Parameter(torch.ones(4))
    opt = CPUAdam([p])
    p.grad = torch.ones(4, 2)[:, 0]
    with pytest.raises(ValueError, match="a contiguous dense fp32 CPU gradient is required"):
        opt.step()
    with pytest.raises(TypeError, match="must be torch.float16 or torch.bfloat16"):
        opt.attach_copy_out(p, torch.empty(4))
    with pytest.raises(ValueError, match="the target has 5 elements, the parameter 4"):
        opt.attach_copy_out(p, torch.empty(5, dtype=torch.float16))
    with pytest.raises(ValueError, match="not one this optimizer steps"):
        opt.attach_copy_out(torch.nn.Parameter(torch.ones(4)), torch.empty(4, dtype=torch.float16))


def test_the_kernels_leave_torchs_thread_count_alone():
    """Numba's OpenMP pool, starting, sets the process's OpenMP thread count to its own size, which
    torch's intra-op pool shares: each of 2 ranks on 2 cores then ran torch on both cores, and the
    whole offloaded step took about 3x as long (bench_offload_step.py)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from zkit_offload.cpu_adam import CPUAdam\n"
        "p = torch.nn.Parameter(torch.randn(100_000)); p.grad = torch.randn(100_000)\n"
        "CPUAdam([p]).step()\n"
        "import numba\n"
        "print(torch.get_num_threads(), numba.get_num_threads())\n"
    )
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NUMBA_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"], out
