"""``save_checkpoint`` between the micro-steps of a gradient accumulation is refused, naming where
the batch stands (a checkpoint does not hold the accumulated gradients, so a resumed run would step
without them); saved after the batch's step, the resumed run ends where the uninterrupted one does."""
from __future__ import annotations

import pytest

from zkit.testing import run_ranks

from tests.checkpoint_accumulation_ranks import save_inside_and_after_an_accumulation


def test_a_save_inside_an_accumulation_is_refused_and_one_at_the_boundary_resumes_exactly(tmp_path):
    results = run_ranks(save_inside_and_after_an_accumulation, 2, args=(str(tmp_path), [2, 3]), timeout=300)
    for rank, out in enumerate(results):
        for stage, got in out.items():
            assert got["refused"] == (
                "save_checkpoint during gradient accumulation: 1 of the 2 micro-batches of step 2 "
                "(gradient_accumulation_steps 2) have been back-propagated and their gradients wait for the "
                "optimizer step; a checkpoint does not hold them, so a run resumed from it would lose them. Save "
                "after the engine.step() that ends the batch (engine.is_gradient_accumulation_boundary() is True "
                "for that micro-batch)"), (rank, stage)
            assert got["max_diff"] <= 1e-6, (rank, stage, got)
            assert got["lr"] == pytest.approx(got["lr_want"], rel=1e-12), (rank, stage, got)
    assert not (tmp_path / "2" / "inside").exists() and not (tmp_path / "3" / "inside").exists()
