"""LAMB on a tensor-parallel model equals LAMB on the whole model: the trust ratio's norms are
summed over the tensor group for sliced parameters (and over the data-parallel ranks where ZeRO
shards them), at every ZeRO stage, with and without CPU offload, on 2 and 4 gloo ranks."""
from __future__ import annotations

import types

import pytest
import torch

import tp_lamb_ranks
from zkit.optim.lamb import Lamb
from zkit.testing import run_ranks
from zkit_pipeline.tensor_parallel import optimizer_norms

TOLERANCE = 1e-6  # relative to each parameter's largest element, after 4 steps
TWO_RANKS = [(0, "none", "lamb"), (1, "none", "lamb_clip"), (2, "none", "lamb"), (2, "cpu", "lamb"),
             (3, "none", "lamb"), (3, "cpu", "lamb")]
FOUR_RANKS = [(1, "none", "lamb"), (2, "cpu", "lamb"), (2, "none", "lamb_clip")]  # 2 data x 2 tensor


@pytest.mark.parametrize("world, cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["tensor2", "data2xtensor2"])
def test_lamb_with_tensor_parallelism_equals_dense_lamb(world, cases):
    for rank in run_ranks(tp_lamb_ranks.max_relative_diffs, world, args=(cases,), timeout=300):
        assert rank.pop("clip_changes") > 1e-3
        assert rank.keys() == set(cases)
        for case, diff in rank.items():
            assert diff < TOLERANCE, (case, diff)


def _lamb(n: int = 2) -> Lamb:
    return Lamb([torch.nn.Parameter(torch.ones(3)) for _ in range(n)])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda o: o.set_sliced_norms([0, 1], 2, [2], print), ValueError,
         "optimizer 'lamb': set_sliced_norms: parameter index 2 is outside 0..1"),
        (lambda o: o.set_sliced_norms([0, 1], 2, [0], None), TypeError,
         "optimizer 'lamb': set_sliced_norms needs a callable all_reduce, got None"),
        (lambda o: o.set_sliced_norms([0], 2, [0], print), ValueError,
         "optimizer 'lamb': set_sliced_norms got 1 parameter indices for the 2 parameters in param_groups"),
        (lambda o: (o.set_shard_norms([0, 1], 2, print), o.set_sliced_norms([1, 0], 2, [0], print)), ValueError,
         "optimizer 'lamb': set_sliced_norms numbers the parameters differently from the earlier "
         "set_shard_norms / set_sliced_norms call"),
        (lambda o: (o.set_sliced_norms([0, 1], 2, [0], print), o.set_shard_norms([0, 1], 3, print)), ValueError,
         "optimizer 'lamb': set_shard_norms numbers the parameters differently"),
    ],
)
def test_set_sliced_norms_rejects_bad_mappings(call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call(_lamb())


def test_a_non_elementwise_optimizer_without_sliced_norms_is_refused():
    record = types.SimpleNamespace(name="trust", elementwise=False)
    engine = types.SimpleNamespace(partitioner=types.SimpleNamespace(ctx=types.SimpleNamespace(optimizer=record)),
                                   optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(ValueError, match=(
            r"optimizer 'trust' is not elementwise \(it needs whole-parameter norms\) and cannot step on parameters "
            r"sliced by tensor parallelism over 2 ranks: it has no set_sliced_norms")):
        optimizer_norms.configure(engine, None, 2)
    record = types.SimpleNamespace(name="sgd", elementwise=True)  # elementwise: nothing to do
    engine.partitioner.ctx.optimizer = record
    optimizer_norms.configure(engine, None, 2)
