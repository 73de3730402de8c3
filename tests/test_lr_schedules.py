"""The built-in LR schedules: formula values, DeepSpeed's own numbers, checkpoints, errors."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.lr_schedules.plugin import zkit_register_schedulers
from zkit.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

FACTORIES = {r.name: r.factory for r in zkit_register_schedulers()}


def adam(lr: float = 0.03, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=lr)


def trajectory(name: str, params: dict, steps: int, optimizer=None, key: str = "lr") -> list:
    """The optimizer's value of ``key`` at construction and after each of ``steps`` steps."""
    optimizer = optimizer or adam()
    sched = FACTORIES[name.lower()](optimizer, **params)
    read = (lambda: optimizer.param_groups[0]["lr"]) if key == "lr" else (lambda: optimizer.param_groups[0]["betas"][0])
    out = [read()]
    for _ in range(steps):
        sched.step()
        out.append(read())
    return out


# --- the records -----------------------------------------------------------------------------------

def test_records_are_lr_schedules_with_deepspeed_names():
    records = list(zkit_register_schedulers())
    assert sorted(r.name for r in records) == ["lrrangetest", "onecycle", "warmupcosinelr", "warmupdecaylr", "warmuplr"]
    assert all(r.kind == "lr" and r.description for r in records)


# --- values from the formulas, written out independently -----------------------------------------

def test_warmup_lr_log_formula():
    lo, hi, w = 0.001, 0.01, 5
    expected = [lo] + [lo + (hi - lo) * math.log(i + 1) / math.log(w) if i < w else hi for i in range(8)]
    got = trajectory("WarmupLR", dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w), 8)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_warmup_lr_linear_formula_and_default_max_is_optimizer_lr():
    got = trajectory("WarmupLR", dict(warmup_num_steps=4, warmup_type="linear"), 6, optimizer=adam(lr=0.02))
    assert got == pytest.approx([0.0, 0.0, 0.005, 0.01, 0.015, 0.02, 0.02])


def test_warmup_lr_one_step_warmup_uses_two_steps_like_deepspeed():
    got = trajectory("WarmupLR", dict(warmup_max_lr=0.1, warmup_num_steps=1, warmup_type="linear"), 3)
    assert got == pytest.approx([0.0, 0.0, 0.05, 0.1])


def test_warmup_decay_lr_formula():
    t, w, hi = 10, 3, 0.01
    expected = [0.0] + [hi * i / w if i < w else hi * max(0.0, (t - i) / (t - w)) for i in range(13)]
    got = trajectory("WarmupDecayLR", dict(total_num_steps=t, warmup_max_lr=hi, warmup_num_steps=w,
                                           warmup_type="linear"), 13)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_cosine_lr_formula():
    base, t, w, wmin, cmin = 0.03, 10, 3, 0.1, 0.05

    def ratio(i):
        if i < w:
            return wmin + (1 - wmin) * i / w
        p = min(1.0, (i - w + 1) / (t - w))
        return cmin + (1 - cmin) * (1 + math.cos(math.pi * p)) / 2

    expected = [0.0] + [base * ratio(i) for i in range(13)]
    got = trajectory("WarmupCosineLR", dict(total_num_steps=t, warmup_min_ratio=wmin, warmup_num_steps=w,
                                            cos_min_ratio=cmin, warmup_type="linear"), 13)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_one_cycle_formula_lr_and_momentum():
    lo, hi, f, s, mlo, mhi = 0.01, 0.1, 4, 6, 0.85, 0.95
    rate, dstep, mrate = 0.5, 2, 0.01

    def scale(i):
        n = i + 1
        return n / f if n <= f else (f + s - n) / s

    lrs = [lo + (hi - lo) * scale(i) if i < f + s else lo / (1 + rate * (i - f - s + 1) / dstep) for i in range(-1, 16)]
    moms = [mhi - (mhi - mlo) * scale(i) if i < f + s else mhi * (1 + mrate * (i - f - s + 1) / dstep)
            for i in range(-1, 16)]
    params = dict(cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=f, cycle_second_step_size=s,
                  decay_lr_rate=rate, decay_step_size=dstep, cycle_min_mom=mlo, cycle_max_mom=mhi,
                  decay_mom_rate=mrate)
    assert trajectory("OneCycle", params, 16) == pytest.approx(lrs, rel=1e-12)
    assert trajectory("OneCycle", params, 16, key="betas") == pytest.approx(moms, rel=1e-12)


def test_one_cycle_stairs_hold_values_flat():
    # 6 steps up in 3 stairs, 4 steps down in 2 stairs; lr = 0.001 + 0.009 * stair / count.
    got = trajectory("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=6,
                                      cycle_second_step_size=4, cycle_first_stair_count=3,
                                      cycle_second_stair_count=2), 12)
    up = [0.001 + 0.009 * k / 3 for k in (0, 0, 1, 1, 2, 2, 3)]
    down = [0.001 + 0.009 * k / 2 for k in (1, 1, 0)]
    assert got == pytest.approx(up + down + [0.001] * 3, rel=1e-12)


def test_lr_range_test_formula_continuous_and_staircase():
    got = trajectory("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3,
                                         lr_range_test_step_rate=2.0), 7)
    assert got == pytest.approx([0.001] + [0.001 * (1 + 2.0 * (i + 1) / 3) for i in range(7)], rel=1e-12)
    got = trajectory("LRRangeTest", dict(lr_range_test_min_lr=0.002, lr_range_test_step_size=2,
                                         lr_range_test_step_rate=0.5, lr_range_test_staircase=True), 7)
    assert got == pytest.approx([0.002] + [0.002 * (1 + 0.5 * ((i + 1) // 2)) for i in range(7)], rel=1e-12)


# --- DeepSpeed 0.19.8's numbers for the same configs (recorded from deepspeed.runtime.lr_schedules) ---

DEEPSPEED = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=5, warmup_type="log"),
     [0.001, 0.001, 0.0048760890226605385, 0.007143455750373869, 0.008752178045321076, 0.010000000000000002,
      0.010000000000000002, 0.010000000000000002, 0.010000000000000002]),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_max_lr=0.05, warmup_num_steps=4),
     [0.0, 0.0, 0.025, 0.03962406251802891, 0.05, 0.05, 0.043750000000000004, 0.037500000000000006, 0.03125,
      0.025, 0.018750000000000003, 0.0125, 0.00625, 0.0, 0.0]),
    ("WarmupCosineLR", dict(total_num_steps=9, warmup_num_steps=4, warmup_type="log"),
     [0.0, 0.0, 0.015, 0.023774437510817342, 0.03, 0.02713554139013265, 0.01963629139013265,
      0.010366708609867352, 0.002867458609867352, 3e-06, 3e-06, 3e-06]),
    ("WarmupCosineLR", dict(total_num_steps=10, warmup_min_ratio=0.1, warmup_num_steps=3, cos_min_ratio=0.05,
                            warmup_type="linear"),
     [0.0, 0.003, 0.012, 0.020999999999999998, 0.02858880636760947, 0.024634729676486954, 0.01892092330887748,
      0.012579076691122518, 0.006865270323513047, 0.0029111936323905287, 0.0015, 0.0015, 0.0015, 0.0015]),
    ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=6, cycle_first_stair_count=3,
                      cycle_second_stair_count=2, cycle_second_step_size=4),
     [0.001, 0.001, 0.004, 0.004, 0.007, 0.007, 0.010000000000000002, 0.0055000000000000005,
      0.0055000000000000005, 0.001, 0.001, 0.001, 0.001]),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3, lr_range_test_step_rate=2.0),
     [0.001, 0.0016666666666666666, 0.002333333333333333, 0.003, 0.0036666666666666666, 0.004333333333333334,
      0.005, 0.005666666666666667]),
]


@pytest.mark.parametrize("name,params,expected", DEEPSPEED, ids=[c[0] for c in DEEPSPEED])
def test_matches_deepspeed_bit_for_bit(name, params, expected):
    assert trajectory(name, params, len(expected) - 1) == expected


def test_one_cycle_momentum_matches_deepspeed_after_construction():
    # DeepSpeed 0.19.8 starts at cycle_min_mom (0.85) and then follows the formula; zkit starts at
    # the formula's own value, cycle_max_mom.
    ds = [0.85, 0.9249999999999999, 0.9, 0.875, 0.85, 0.8666666666666667, 0.8833333333333333,
          0.8999999999999999, 0.9166666666666666, 0.9333333333333332, 0.95, 0.9547499999999999,
          0.9594999999999999, 0.9642499999999998, 0.969, 0.9737499999999999, 0.9784999999999999]
    got = trajectory("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                                      cycle_second_step_size=6, decay_lr_rate=0.5, decay_step_size=2,
                                      cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.01), 16, key="betas")
    assert got[0] == 0.95
    assert got[1:] == ds[1:]


# --- momentum targets ------------------------------------------------------------------------------

def test_one_cycle_keeps_adams_second_beta_and_cycles_sgd_momentum():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 0.95))
    OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2).step()
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.85), 0.95)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    sched = OneCycle(sgd, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2, cycle_min_mom=0.5)
    sched.step()
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.7)


def test_one_cycle_without_momentum_is_skipped_by_default_and_refused_when_asked():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))])
    assert OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0).cycle_momentum is False
    with pytest.raises(ValueError, match=re.escape(
            "scheduler 'OneCycle': cycle_momentum=true but Adagrad has neither 'betas' nor 'momentum'")):
        OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_momentum=True)


def test_one_cycle_momentum_reaching_one_is_an_error():
    sched = OneCycle(adam(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=1, decay_step_size=1,
                     decay_mom_rate=0.1)
    with pytest.raises(ValueError, match=r"momentum reached 1\.08 >= 1 at iteration 3; lower decay_mom_rate"):
        for _ in range(4):
            sched.step()


# --- per-group values, tensor lrs, get_last_lr -------------------------------------------------------

def test_per_group_lists_and_length_check():
    opt = adam(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2, warmup_type="linear")
    sched.step(1)
    assert sched.get_last_lr() == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match=re.escape(
            "scheduler 'WarmupLR': warmup_max_lr has 3 values but the optimizer has 2 param groups")):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


def test_tensor_lr_stays_a_tensor():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01))
    lr = opt.param_groups[0]["lr"]
    WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=2, warmup_type="linear").step(1)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.25)


def test_get_last_lr_is_set_at_construction():
    assert OneCycle(adam(), cycle_min_lr=0.01, cycle_max_lr=0.1).get_last_lr() == [0.01]
    assert WarmupCosineLR(adam(), total_num_steps=10, warmup_num_steps=2).get_last_lr() == [0.0]


# --- checkpoints -----------------------------------------------------------------------------------

RESUMABLE = [
    ("WarmupLR", dict(warmup_num_steps=4)),  # max lr read from the optimizer
    ("WarmupDecayLR", dict(total_num_steps=9, warmup_num_steps=3, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=9, warmup_num_steps=3, warmup_min_ratio=0.2)),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, decay_step_size=2,
                      decay_lr_rate=0.3, decay_mom_rate=0.01)),
    ("LRRangeTest", dict(lr_range_test_step_size=2, lr_range_test_staircase=True)),
]


@pytest.mark.parametrize("name,params", RESUMABLE, ids=[c[0] for c in RESUMABLE])
def test_state_dict_round_trip_continues_identically(name, params):
    full = trajectory(name, params, 12)
    opt = adam()
    sched = FACTORIES[name.lower()](opt, **params)
    for _ in range(5):
        sched.step()
    saved_sched, saved_opt = sched.state_dict(), opt.state_dict()
    # Resume the way a trainer does: rebuild on an optimizer that already holds the saved lr.
    opt2 = adam()
    opt2.load_state_dict(saved_opt)
    sched2 = FACTORIES[name.lower()](opt2, **params)
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["lr"] == full[5]
    resumed = []
    for _ in range(7):
        sched2.step()
        resumed.append(opt2.param_groups[0]["lr"])
    assert resumed == full[6:]


def test_loads_a_deepspeed_state_dict():
    sched = WarmupDecayLR(adam(), total_num_steps=10, warmup_max_lr=0.01, warmup_num_steps=2, warmup_type="linear")
    sched.load_state_dict({"last_batch_iteration": 6})
    assert sched.get_last_lr() == pytest.approx([0.01 * 4 / 8])
    with pytest.raises(ValueError, match=re.escape("state dict has no 'last_batch_iteration'")):
        sched.load_state_dict({"step": 3})


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,message", [
    ("WarmupLR", dict(warmup_max_lrr=0.1),
     "unknown parameter 'warmup_max_lrr' for scheduler 'WarmupLR'; did you mean 'warmup_max_lr'? valid: "
     "last_batch_iteration, warmup_max_lr, warmup_min_lr, warmup_num_steps, warmup_type"),
    ("OneCycle", dict(cycle_min_lr=0.1, cycle_max_lr=1, cycle_momentun=True),
     "unknown parameter 'cycle_momentun' for scheduler 'OneCycle'; did you mean 'cycle_momentum'?"),
    ("WarmupDecayLR", dict(), "scheduler 'WarmupDecayLR' needs parameter 'total_num_steps'"),
    ("OneCycle", dict(), "scheduler 'OneCycle' needs parameters 'cycle_min_lr', 'cycle_max_lr'"),
    ("WarmupDecayLR", dict(total_num_steps=5, warmup_num_steps=10),
     "scheduler 'WarmupDecayLR': total_num_steps (5) is less than warmup_num_steps (10)"),
    ("WarmupCosineLR", dict(total_num_steps=5, warmup_num_steps=10),
     "scheduler 'WarmupCosineLR': total_num_steps (5) is less than warmup_num_steps (10)"),
    ("WarmupLR", dict(warmup_type="cosine"),
     "scheduler 'WarmupLR': warmup_type must be one of 'log', 'linear', got 'cosine'"),
    ("WarmupLR", dict(warmup_num_steps=0), "scheduler 'WarmupLR': warmup_num_steps must be >= 1, got 0"),
    ("WarmupLR", dict(warmup_num_steps=2.5), "scheduler 'WarmupLR': warmup_num_steps must be an integer, got 2.5"),
    ("WarmupLR", dict(warmup_min_lr=-0.1), "scheduler 'WarmupLR': warmup_min_lr must be >= 0, got -0.1"),
    ("WarmupLR", dict(warmup_min_lr=0.2, warmup_max_lr=0.1),
     "scheduler 'WarmupLR': warmup_max_lr (0.1) is below warmup_min_lr (0.2)"),
    ("WarmupCosineLR", dict(total_num_steps=10, warmup_num_steps=2, cos_min_ratio=1.5),
     "scheduler 'WarmupCosineLR': cos_min_ratio must be <= 1, got 1.5"),
    ("OneCycle", dict(cycle_min_lr=0.2, cycle_max_lr=0.1),
     "scheduler 'OneCycle': cycle_min_lr (0.2) is above cycle_max_lr (0.1)"),
    ("OneCycle", dict(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_max_mom=1.0),
     "scheduler 'OneCycle': cycle_max_mom must be < 1, got 1.0"),
    ("OneCycle", dict(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_first_step_size=0),
     "scheduler 'OneCycle': cycle_first_step_size must be >= 1, got 0"),
    ("OneCycle", dict(cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_momentum="yes"),
     "scheduler 'OneCycle': cycle_momentum must be true or false, got 'yes'"),
    ("LRRangeTest", dict(lr_range_test_step_size=-1),
     "scheduler 'LRRangeTest': lr_range_test_step_size must be >= 1, got -1"),
    ("LRRangeTest", dict(lr_range_test_min_lr=float("nan")),
     "scheduler 'LRRangeTest': lr_range_test_min_lr must be a finite number, got nan"),
])
def test_bad_params_are_named(name, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FACTORIES[name.lower()](adam(), **params)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match=re.escape("scheduler 'WarmupLR': expected a torch.optim.Optimizer, got int")):
        WarmupLR(3)


# --- properties ------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(lo=st.floats(0, 1), span=st.floats(0, 1), f=st.integers(1, 20), s=st.integers(0, 20),
       c1=st.integers(0, 5), c2=st.integers(0, 5), i=st.integers(-1, 60))
def test_one_cycle_stays_between_its_bounds(lo, span, f, s, c1, c2, i):
    sched = OneCycle(adam(), cycle_min_lr=lo, cycle_max_lr=lo + span, cycle_first_step_size=f,
                     cycle_second_step_size=s, cycle_first_stair_count=c1, cycle_second_stair_count=c2)
    assert 0.0 <= sched.scale_at(i) <= 1.0
    (lr,) = sched.lr_at(i)
    assert lo - 1e-12 <= lr <= lo + span + 1e-12
    (mom,) = sched.momentum_at(i)
    assert 0.8 - 1e-12 <= mom <= 0.9 + 1e-12


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 50), extra=st.integers(0, 50), kind=st.sampled_from(["log", "linear"]),
       wmin=st.floats(0, 1), cmin=st.floats(0, 1))
def test_warmup_schedules_rise_then_fall(w, extra, kind, wmin, cmin):
    t = w + extra
    decay = WarmupDecayLR(adam(), total_num_steps=t, warmup_max_lr=1.0, warmup_num_steps=w, warmup_type=kind)
    cosine = WarmupCosineLR(adam(lr=1.0), total_num_steps=t, warmup_num_steps=w, warmup_type=kind,
                            warmup_min_ratio=wmin, cos_min_ratio=cmin)
    warm = max(2, w)  # DeepSpeed warms up over at least two steps
    for sched in (decay, cosine):
        lrs = [sched.lr_at(i)[0] for i in range(t + 5)]
        rise, fall = lrs[:warm], lrs[warm:]
        assert all(a <= b + 1e-12 for a, b in zip(rise, rise[1:]))
        assert all(a >= b - 1e-12 for a, b in zip(fall, fall[1:]))
        assert all(0.0 <= x <= 1.0 + 1e-12 for x in lrs)
    assert decay.lr_at(t + 4) == [0.0]
    assert cosine.lr_at(t + 4) == [pytest.approx(cmin)]
