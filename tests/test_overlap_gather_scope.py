"""``zero_optimization.overlap_param_gather`` applies where stages 1-2 all-gather the updated
parameters after the step; elsewhere it has no effect, and initialize says so rather than
ignoring it (the overlap itself: tests/test_zero_equivalence.py; beside every other feature:
tests/composition.py)."""
from __future__ import annotations

import logging

import pytest
import torch

import zkit


def _initialize(stage: int, overlap: bool):
    torch.manual_seed(0)
    engine, *_ = zkit.initialize(model=torch.nn.Linear(4, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "overlap_param_gather": overlap}})
    engine.close()


@pytest.mark.parametrize("stage, why", [
    (0, "ZeRO stage 0 keeps whole parameters on every rank: there is no parameter all-gather to overlap"),
    (1, "one data-parallel replica holds every shard: there is no parameter all-gather to overlap"),
    (3, "ZeRO stage 3 gathers each parameter inside forward (stage3_prefetch_bucket_size sets how far ahead)"),
])
def test_overlap_param_gather_without_effect_is_said(caplog, stage, why):
    with caplog.at_level(logging.WARNING, logger="zkit"):
        _initialize(stage, True)
    said = [r.getMessage() for r in caplog.records if "overlap_param_gather" in r.getMessage()]
    assert said == [f"zero_optimization.overlap_param_gather has no effect here: {why}; it applies at stages 1-2 "
                    f"over several data-parallel replicas"]


def test_overlap_param_gather_off_says_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="zkit"):
        _initialize(0, False)
    assert not [r for r in caplog.records if "overlap_param_gather" in r.getMessage()]
