"""A tensor-parallel model under ``engine.compile()`` compiles into one graph without a break (its
collectives, issued from autograd functions in forward and backward, are traced through the
communicator) and trains bit-equal to the eager run; eagerly, the tensor group's collectives are
counted and go through a third-party communicator chosen by ``zkit.Stack`` (2 gloo ranks, Dynamo's
``aot_eager`` backend, 3 steps of ZeRO-2)."""
from __future__ import annotations

import pytest
import torch

import tp_compile_ranks as tcr
from zkit.testing import run_ranks

EAGER, COMPILED = (False, False), (True, False)
CUSTOM_EAGER, CUSTOM_COMPILED = (False, True), (True, True)


@pytest.fixture(scope="module")
def results():
    return run_ranks(tcr.compare, 2, timeout=300)


def _equal(run, eager, where):
    assert torch.equal(torch.stack(run["losses"]), torch.stack(eager["losses"])), (where, run["losses"], eager["losses"])
    for name, p in eager["params"].items():
        assert torch.equal(run["params"][name], p), (where, name, float((run["params"][name] - p).abs().max()))


def test_compiles_without_graph_breaks_and_trains_as_eager(results):
    for result in results:
        eager, compiled = result["runs"][EAGER], result["runs"][COMPILED]
        assert eager["graphs"] == 0
        assert compiled["graph_breaks"] == {}, compiled["graph_breaks"]
        assert compiled["graphs"] == 1, "one graph, compiled once (the FLOP-probed step 1 runs eagerly)"
        _equal(compiled, eager, result["rank"])


def test_tensor_group_collectives_are_counted_eagerly(results):
    for result in results:
        stats = result["runs"][EAGER]["tensor_stats"]
        # per step, forward: embedding, 2 row layers (all-reduce), 1 gathering column (all-gather);
        # backward: 2 column layers' input gradients and the scattering row layer's (all-gather)
        assert stats["all_reduce"]["calls"] == 5 * tcr.STEPS, stats
        assert stats["all_gather"]["calls"] == 2 * tcr.STEPS, stats
        # inside the compiled graph they are not counted: only the eager (FLOP-probed) first step is
        compiled = result["runs"][COMPILED]["tensor_stats"]
        assert compiled == {k: {"calls": v["calls"] // tcr.STEPS, "bytes": v["bytes"] // tcr.STEPS}
                            for k, v in stats.items()}, compiled


def test_a_third_party_communicator_carries_the_tensor_group(results):
    for result in results:
        eager = result["runs"][CUSTOM_EAGER]
        assert eager["tensor_comm"] == "CountingCommunicator"
        assert eager["tensor_calls"] == {"all_reduce": 5 * tcr.STEPS, "all_gather": 2 * tcr.STEPS}
        _equal(eager, result["runs"][EAGER], result["rank"])
        # compiled, Dynamo traces through the wrapper: the same numbers, whatever it compiled
        _equal(result["runs"][CUSTOM_COMPILED], eager, result["rank"])


def test_each_traced_collective_equals_eager(results):
    for result in results:
        assert result["collectives"] == {"equal": [True, True, True], "graphs": 1}, result["rank"]
