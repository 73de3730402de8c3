"""The torch communicator's flat collectives against their definitions, on gloo ranks (where
all-gather and reduce-scatter run as per-rank broadcasts and reduces)."""
import pytest
import torch

from zkit.testing import run_ranks

import comm_ranks as cr


@pytest.mark.parametrize("world", (2, 3))
def test_flat_collectives_match_their_definition(world):
    shard = 1001  # odd: chunks do not line up with anything
    results = run_ranks(cr.flat_collectives, world, args=(shard,), timeout=120)
    inputs = [cr.rank_input(r, world * shard) for r in range(world)]
    stacked = torch.stack(inputs)
    expected_gather = torch.cat([cr.rank_input(r, shard) for r in range(world)])
    reduced = {"sum": stacked.sum(0), "avg": stacked.sum(0) / world, "max": stacked.max(0).values}
    for r, out in enumerate(results):
        assert torch.equal(out["all_gather"], expected_gather)
        assert torch.equal(out["all_gather_in_place"], expected_gather)
        for op, full in reduced.items():
            mine = full[r * shard : (r + 1) * shard]
            assert torch.allclose(out[f"reduce_scatter_{op}"], mine, rtol=1e-6), op
            assert torch.allclose(out[f"reduce_scatter_{op}_in_place"], mine, rtol=1e-6), op
        # ring volumes: (N-1)/N of the full tensor per call, whatever the algorithm underneath
        full_bytes = world * shard * 4
        assert out["stats"]["all_gather"]["bytes"] == 2 * ((world - 1) * full_bytes // world)
        assert out["stats"]["reduce_scatter"]["bytes"] == 6 * ((world - 1) * full_bytes // world)
