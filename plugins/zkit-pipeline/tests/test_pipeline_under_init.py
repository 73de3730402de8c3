"""A pipeline of 2 stages built under zkit.zero.Init is refused as it is built, on every rank,
naming Init and the pipeline: Init's per-module broadcasts span every rank while each stage builds
only its own layers (LayerSpecs were built on the meta device and failed to partition), and a tied
module's broadcast wrote into the released parameters Init left, past their single element."""
from __future__ import annotations

import pytest

import pipeline_init_ranks
from zkit.testing import run_ranks


@pytest.mark.parametrize("specs", [True, False], ids=["layer-specs", "modules"])
def test_pipeline_built_under_init_is_refused(specs):
    for rank, got in enumerate(run_ranks(pipeline_init_ranks.pipeline_under_init, 2, args=(specs,), timeout=300)):
        assert got["raised"].startswith(
            "ValueError: PipelineModule: zkit.zero.Init cannot build a model for pipeline parallelism (2 pipeline "
            "stages)"), (rank, got)
