"""Every built-in schedule, for many (p, m, v): deadlock-free, complete, and with the bubble theory
predicts - proven by simulating all stages' streams without processes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_pipeline.schedules import (
    BUILTIN_SCHEDULES,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    forward_only,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    zb_h1,
)
from zkit_pipeline.simulate import DEFAULT_COSTS, simulate


def streams(factory, p, m, **kw):
    return [list(factory(p, s, m, **kw)) for s in range(p)]


def chunk_costs(v):
    return {k: c / v for k, c in DEFAULT_COSTS.items()}


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 24), name=st.sampled_from(["gpipe", "1f1b", "zb_h1"]))
def test_flat_schedules_are_complete_and_deadlock_free(p, m, name):
    result = simulate(streams(BUILTIN_SCHEDULES[name], p, m), m)
    # every stage computes m micro-batches' worth: F + B (or F + B + W) = 3 units each
    assert all(b == pytest.approx(3 * m) for b in result.busy)
    if name != "gpipe":
        # 1F1B's memory bound: stage s never holds more than p - s micro-batches
        assert all(peak <= min(p - s, m) for s, peak in enumerate(result.peak_in_flight))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 6), groups=st.integers(1, 4), v=st.integers(1, 4))
def test_interleaved_is_complete_and_deadlock_free(p, groups, v):
    m = p * groups
    result = simulate(streams(interleaved_1f1b, p, m, virtual_stages=v), m, v, costs=chunk_costs(v))
    assert result.bubble_ratio == pytest.approx((p - 1) / (v * m))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 24))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(p, m):
    for factory in (gpipe, one_f_one_b):
        assert simulate(streams(factory, p, m), m).bubble_ratio == pytest.approx((p - 1) / m)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(2, 24))
def test_zb_h1_bubble_below_1f1b_with_the_same_memory(p, m):
    costs = {Forward: 1.0, Backward: 2.0}
    ref = simulate(streams(one_f_one_b, p, m), m, costs=costs)
    zb = simulate(streams(zb_h1, p, m), m)
    assert zb.bubble_ratio < ref.bubble_ratio
    assert zb.peak_in_flight == ref.peak_in_flight


def test_gpipe_holds_every_micro_batch_1f1b_at_most_p():
    p, m = 4, 16
    assert simulate(streams(gpipe, p, m), m).peak_in_flight == (16, 16, 16, 16)
    assert simulate(streams(one_f_one_b, p, m), m).peak_in_flight == (4, 3, 2, 1)


def test_forward_only_stream_simulates_without_backward():
    p, m, v = 3, 6, 2
    result = simulate(streams(forward_only, p, m, virtual_stages=v), m, v, train=False)
    assert all(b == pytest.approx(m * v) for b in result.busy)


def test_1f1b_steady_state_batches_send_with_the_next_receive():
    stream = list(one_f_one_b(4, 1, 8))
    i = stream.index(SendActivation(2, 0))
    assert stream[i + 1] == RecvGrad(0, 0)  # posted together: one exchange


# -- inconsistent streams are caught, naming the problem ------------------------------------------


def test_mismatched_transfer_order_is_reported():
    p = 3  # stage 1 receives micro-batches in the wrong order
    s0 = list(lower([Forward(0), Forward(1), Backward(0), Backward(1)], p, 0))
    s1 = list(lower([Forward(1), Forward(0), Backward(0), Backward(1)], p, 1))
    s2 = list(lower([Forward(0), Backward(0), Forward(1), Backward(1)], p, 2))
    with pytest.raises(ScheduleError, match="transfer 0 from stage 0 to stage 1 does not match"):
        simulate([s0, s1, s2], 2)


def test_deadlock_is_reported_with_each_waiting_stage():
    # stage 1 waits for a gradient before it has sent the activation stage 0 is waiting on
    s0 = list(lower([Forward(0), Backward(0)], 3, 0))
    s1 = [RecvGrad(0), RecvActivation(0), Forward(0), SendActivation(0), Backward(0)]
    s2 = list(lower([Forward(0), Backward(0)], 3, 2))
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0, instruction \d+ \(RecvGrad\(0, 0\)\) waits"):
        simulate([s0, s1, s2], 1)


def test_missing_backward_is_reported():
    s = list(lower([Forward(0), Forward(1), Backward(0)], 1, 0))
    with pytest.raises(ScheduleError, match=r"stage 0 never runs a backward for .*\(1, 0\)"):
        simulate([s], 2)


def test_duplicate_forward_is_reported():
    s = list(lower([Forward(0), Forward(0), Backward(0)], 1, 0))
    with pytest.raises(ScheduleError, match="runs Forward twice"):
        simulate([s], 1)


def test_compute_before_input_is_reported():
    s0 = list(lower([Forward(0), Backward(0)], 3, 0))
    s1 = [Forward(0), RecvActivation(0)]
    with pytest.raises(ScheduleError, match="runs before its input was received"):
        simulate([s0, s1, []], 1)


def test_send_before_compute_is_reported():
    s0 = [SendGrad(0)]
    with pytest.raises(ScheduleError, match="sends a result it has not computed yet"):
        simulate([[], s0], 1)


def test_step_must_come_last():
    s = [*lower([Forward(0), Backward(0)], 1, 0), Forward(1)]
    with pytest.raises(ScheduleError, match="comes after OptimizerStep"):
        simulate([s], 2)


# -- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: list(gpipe(0, 0, 4)), "gpipe: num_stages must be an int >= 1, got 0"),
        (lambda: list(one_f_one_b(2, 2, 4)), r"1f1b: stage_id must be in \[0, 2\) for 2 stages, got 2"),
        (lambda: list(zb_h1(2, 0, 0)), "zb_h1: micro_batches must be an int >= 1, got 0"),
        (lambda: list(zb_h1(2, 0, 4, cost_w=0)), "zb_h1: cost_w must be > 0, got 0"),
        (
            lambda: list(interleaved_1f1b(4, 0, 6, virtual_stages=2)),
            r"interleaved_1f1b: micro_batches \(6\) must be a multiple of num_stages \(4\)",
        ),
        (
            lambda: list(interleaved_1f1b(1, 0, 4, virtual_stages=2)),
            "virtual_stages > 1 needs num_stages >= 2",
        ),
        (lambda: Forward(-1), "micro_batch must be a non-negative int, got -1"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
