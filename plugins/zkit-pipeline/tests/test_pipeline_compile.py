"""``torch.compile`` of a PipelineModule engine (``zkit.core.compile``): the stage's chunks run
through the module's call, so ``engine.compile()`` and ``initialize(model=torch.compile(module))``
compile them, as DeepSpeed's pipeline engine compiles its stage module; training and evaluation
give the eager pipeline's losses (Dynamo's ``aot_eager`` backend, 2 stages on 2 gloo ranks; the
interleaved schedule runs two chunks per stage; one run recomputes each layer in backward under
zkit's activation checkpoint, inside the compiled chunk)."""
from __future__ import annotations

import pytest

import pp_compile_ranks as pcr
from zkit.testing import run_ranks


def test_a_compiled_pipeline_engine_trains_as_the_eager_one():
    results = run_ranks(pcr.compare, 2, timeout=300)
    for result in results:
        runs = result["runs"]
        for how, schedule, interval in pcr.COMPILED:
            eager = runs[("eager", schedule, interval)]
            assert not eager["compiled"] and eager["graphs"] == 0
            run, where = runs[(how, schedule, interval)], (result["rank"], how, schedule, interval)
            assert run["compiled"], where
            assert run["graphs"] >= 1, f"{where}: the stage's layers ran uncompiled"
            assert run["names"] == eager["names"], where
            assert run["losses"] == pytest.approx(eager["losses"], rel=1e-6), where
            assert run["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-6), where
            diff = max(float((a - b).abs().max()) for a, b in zip(run["params"], eager["params"]))
            assert diff < 1e-6, (where, diff)
