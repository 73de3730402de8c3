"""fp16 dynamic loss scaling follows DeepSpeed's rules."""
import pytest

from zkit.core.precision import LossScaleAtMinimum, LossScaler


def test_static_scale_never_changes():
    s = LossScaler(enabled=True, loss_scale=128.0)
    for overflow in (True, False, True):
        s.update(overflow, 1)
    assert s.scale == 128.0 and not s.dynamic


def test_disabled_scale_is_one():
    assert LossScaler(enabled=False).scale == 1.0


def test_overflow_shrinks_after_hysteresis_and_window_grows():
    s = LossScaler(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    assert s.scale == 16.0
    s.update(True, 1)  # first overflow is absorbed by hysteresis
    assert s.scale == 16.0
    s.update(True, 2)
    assert s.scale == 8.0
    for step in range(3, 6):
        s.update(False, step)
    assert s.scale == 16.0  # grew after loss_scale_window clean steps


def test_minimum_scale_overflow_names_the_step():
    s = LossScaler(enabled=True, initial_scale_power=0, hysteresis=1, min_loss_scale=1.0)
    with pytest.raises(LossScaleAtMinimum, match=r"overflowed at step 7 with the loss scale already at its minimum 1"):
        s.update(True, 7)


def test_state_round_trip():
    s = LossScaler(enabled=True, initial_scale_power=5, loss_scale_window=2, hysteresis=1)
    s.update(True, 1)
    t = LossScaler(enabled=True, initial_scale_power=5, loss_scale_window=2, hysteresis=1)
    t.load_state_dict(s.state_dict())
    for step in range(4):
        s.update(step == 2, step)
        t.update(step == 2, step)
    assert s.state_dict() == t.state_dict()
