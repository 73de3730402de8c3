"""A NaN or infinity in bf16/fp32 training skips the step with a warning (as fp16's overflow does)
and stops the job, naming the step, after ``nonfinite_steps_limit`` such steps in a row. The
verdicts stay on the device and are read every ``steps_per_print`` steps: most tests here print
every step, so each step's verdict is read at that step."""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.testing import run_ranks

from tests.nonfinite_ranks import (nan_gradient_under_a_finite_loss, padding_of_reduced_shards,
                                   skip_when_one_rank_sees_nan)


def _engine(**extra):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "steps_per_print": 1, **extra}
    return zkit.initialize(model=torch.nn.Linear(4, 2), config=cfg)[0]


def _step(engine, bad: bool) -> None:
    x = torch.ones(2, 4, dtype=engine.dtype)
    if bad:
        x[0, 0] = float("inf")
    loss = (engine(x).float() * 0.5).sum() * (float("nan") if bad else 1.0)
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("extra", [{}, {"gradient_clipping": 1.0}, {"bf16": {"enabled": True}}],
                         ids=["fp32-loss-check", "fp32-norm", "bf16-loss-check"])
def test_nonfinite_step_is_skipped_with_a_warning(extra, caplog):
    engine = _engine(**extra)
    _step(engine, bad=False)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with caplog.at_level("WARNING", logger="zkit"):
        _step(engine, bad=True)
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert "step 2: the loss or the gradients are NaN or infinite; step skipped (1 in a row, the job stops after 10)" in caplog.text
    _step(engine, bad=False)  # a good step resets the count and trains on
    assert engine.was_step_applied()
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


@pytest.mark.parametrize("extra", [{}, {"gradient_clipping": 1.0}], ids=["gradients-checked", "norm-for-clipping"])
def test_gradients_whose_squares_overflow_skip_the_step_with_or_without_clipping(extra):
    # Finite loss and gradients (5e19), whose squares are past fp32's range: the gradient norm
    # clipping computes is infinite, and the check made without clipping says the same.
    engine = _engine(**extra)
    _step(engine, bad=False)
    loss = (engine(torch.full((2, 4), 1e20)) * 0.5).sum()
    assert torch.isfinite(loss)
    engine.backward(loss)
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1


def test_too_many_nonfinite_steps_in_a_row_stop_the_job_naming_the_step():
    engine = _engine(nonfinite_steps_limit=2)
    _step(engine, bad=False)
    _step(engine, bad=True)
    _step(engine, bad=True)
    with pytest.raises(FloatingPointError, match=r"step 4: the loss or the gradients were NaN or infinite for 3 steps "
                                                 r"in a row \(nonfinite_steps_limit is 2\); training stopped"):
        _step(engine, bad=True)


def test_verdicts_read_every_steps_per_print_stop_the_job_naming_the_step_that_crossed_the_limit(caplog):
    # steps_per_print 4: steps 2 and 3 are skipped on the device, unread, and step 4 trains on;
    # at step 4 the verdicts are read: step 2's warning, then step 3's stop, naming step 3.
    engine = _engine(nonfinite_steps_limit=1, steps_per_print=4)
    for bad in (False, True, True):
        _step(engine, bad=bad)
    assert not caplog.text  # nothing read yet
    with caplog.at_level("WARNING", logger="zkit"):
        with pytest.raises(FloatingPointError) as err:
            _step(engine, bad=False)
    assert "step 2: the loss or the gradients are NaN or infinite; step skipped (1 in a row, the job stops after 1)" \
        in caplog.text
    assert str(err.value) == (
        "step 3: the loss or the gradients were NaN or infinite for 2 steps in a row (nonfinite_steps_limit is 1); "
        "training stopped. Lower the learning rate, enable gradient_clipping, or look for bad inputs in the batches "
        "before step 3")


def test_skipped_steps_and_the_grad_norm_read_lazily_are_those_of_the_steps():
    engine = _engine(gradient_clipping=1.0, steps_per_print=1000)
    for bad in (False, True, False, True, True):
        _step(engine, bad=bad)
        norm = engine.get_global_grad_norm()
        assert engine.was_step_applied() == (not bad) and (norm > 0 and not bad or norm != norm and bad)
    assert engine.skipped_steps == 3
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (2, "bf16")])
def test_every_rank_skips_when_one_rank_sees_a_nan(stage, dtype):
    results = run_ranks(skip_when_one_rank_sees_nan, world_size=2, args=(stage, dtype), timeout=120)
    for out in results:
        applied = [a for a, _ in out["steps"]]
        unchanged = [u for _, u in out["steps"]]
        assert applied == [True, False, True] and unchanged[1]
        assert out["skipped"] == 1 and out["finite"]


@pytest.mark.parametrize("stages,target,value", [([0, 1, 2, 3], "second.weight", float("nan")),
                                                 ([1, 2, 3], "first.bias", float("inf"))], ids=["nan", "inf-middle"])
def test_a_nan_gradient_under_a_finite_loss_is_skipped_then_stops_the_job_at_every_stage(stages, target, value):
    # No clipping, no fp16: nothing computes a norm, so the reduced gradients themselves are checked.
    # first.bias: one element of a piece in the middle of rank 0's shard (stages 1-2; at stage 3 of
    # the second unit), made bad by rank 1's backward: the rank owning it after the reduction finds
    # it, and every rank skips.
    results = run_ranks(nan_gradient_under_a_finite_loss, world_size=2, args=(stages, "bf16", target, value),
                        timeout=120)
    for out in results:
        for stage, got in out.items():
            assert got["steps"] == [(True, True, False), (True, False, True)], (stage, got)
            assert got["error"] is not None and got["error"].startswith(
                "step 3: the loss or the gradients were NaN or infinite for 2 steps in a row "
                "(nonfinite_steps_limit is 1)"), (stage, got)
            assert got["finite"], stage


def test_the_padding_of_every_reduced_gradient_shard_is_zero():
    # The check reads whole shards, padding included: a padding element that was not zero (the
    # stage 2-3 shards and buckets are made without zeroing) could fail a good step.
    # (Stage 0 lays units out for one rank: no padding.)
    results = run_ranks(padding_of_reduced_shards, world_size=2, args=([1, 2, 3],), timeout=120)
    for stage in (1, 2, 3):
        padding = [out[stage] for out in results]  # per rank (the last rank's shards hold it)
        assert sum(p["elements"] for p in padding) > 0 and all(p["nonzero"] == 0 for p in padding), (stage, padding)
