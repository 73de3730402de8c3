"""The torch communicator's flat collectives against their definitions, on gloo ranks: gloo's own
per-rank broadcasts and reduces, and the native flat collectives NCCL uses (forced: gloo runs
them too), one by one and coalesced; both give an engine the same parameters."""
import pytest
import torch

from zkit.testing import run_ranks

import comm_ranks as cr


@pytest.mark.parametrize("world,flat", [(2, None), (3, None), (4, None), (2, "native"), (3, "native")])
def test_flat_collectives_match_their_definition(world, flat):
    shard = 1001  # odd: chunks do not line up with anything
    results = run_ranks(cr.flat_collectives, world, args=(shard, flat), timeout=120)
    inputs = [cr.rank_input(r, world * shard) for r in range(world)]
    stacked = torch.stack(inputs)
    expected_gather = torch.cat([cr.rank_input(r, shard) for r in range(world)])
    reduced = {"sum": stacked.sum(0), "avg": stacked.sum(0) / world, "max": stacked.max(0).values}
    for r, out in enumerate(results):
        assert out["kind"] == (flat or "per_rank")  # gloo's own choice
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
        for i, gathered in enumerate(out["coalesced_all_gather"]):
            assert torch.equal(gathered, expected_gather + i)
        for i, result in enumerate(out["coalesced_reduce_scatter_avg"]):
            assert torch.allclose(result, reduced["avg"][r * shard : (r + 1) * shard] * (i + 1), rtol=1e-6)
        if out["kind"] == "native":  # a batch is launched when its block ends
            assert out["misuse"] == [
                "collectives inside comm.coalesced() must be issued with async_op=True",
                "a collective issued inside comm.coalesced() was waited for inside the block; wait after the "
                "block, when the batch has been launched",
            ]
        else:  # gloo's per-rank collectives are issued one by one, batch or not
            assert out["misuse"] == []


def test_an_unknown_flat_collective_kind_is_refused():
    from zkit.torch_distributed.collectives import choose

    message = r"flat collectives 'ring': choose one of native, per_rank \(or None: by backend\)"
    with pytest.raises(ValueError, match=message):
        choose("gloo", "ring")


def test_the_backend_chooses_its_flat_collectives():
    from zkit.torch_distributed.collectives import choose

    assert choose("gloo").kind == "per_rank" and not choose("gloo").native_avg
    assert choose("nccl").kind == "native" and choose("nccl").native_avg and choose("nccl").coalesces
    assert choose("gloo", "native").coalesces and not choose("nccl", "per_rank").coalesces
    # from 4 gloo ranks up, small reduce-scatters are gloo's own; forced kinds hold for every size
    assert choose("gloo", world_size=3).native_reduce_scatter_below == 0
    assert choose("gloo", world_size=4).native_reduce_scatter_below == 4 * 384 * 1024
    assert choose("gloo", world_size=8).native_reduce_scatter_below == 8 * 384 * 1024
    assert choose("gloo", "per_rank", world_size=4).native_reduce_scatter_below == 0
    assert choose("nccl", world_size=8).native_reduce_scatter_below == 0


def test_native_and_per_rank_collectives_train_the_same_parameters():
    for rank in run_ranks(cr.engine_runs, 2, args=([None, "native"],), timeout=300):
        a, b = rank[None], rank["native"]
        for case in a:
            assert (a[case]["kind"], b[case]["kind"]) == ("per_rank", "native")
            assert a["stage3"]["persistent"] == ["norm"]  # persistent units' gathers are batched too
            assert a[case]["losses"] == b[case]["losses"], case
            for x, y in zip(a[case]["params"], b[case]["params"]):
                assert torch.equal(x, y), case


def test_a_broadcast_into_an_expanded_tensor_is_refused_before_it_writes():
    for said in run_ranks(cr.broadcast_into_expanded, 2, timeout=120):
        assert said.startswith("broadcast into a non-contiguous tensor (shape (8,), stride (0,)): it would write "
                               "past the tensor's memory")
