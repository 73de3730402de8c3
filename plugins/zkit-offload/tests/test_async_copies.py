"""Offload's host<->device copies are ordered by their events: with every copy deferred until its
event is waited (zkit.fake_streams, standing in for an accelerator's side stream), training gives
the same parameters and losses as with plain copies, on 2 gloo ranks. A consumer that read a
copy's destination before waiting, or a host write to a source with its copy still pending, would
change them."""
import pytest
import torch

from zkit.testing import run_ranks

import offload_ranks as orr

#: (stage, dtype, offload_optimizer device, offload_param device[, optimizer]): gradients to the
#: host master (stage 2 cpu), the updated master copied into the parameters before their gathers
#: (SGD: a step that does not write them itself), host shards fetched for gathers and written
#: after the step (stage 3 cpu), NVMe master, gradients and shards through reused host buffers
CASES = [(2, "bf16", "cpu", "none", "SGD"), (3, "bf16", "cpu", "cpu"),
         (3, "fp32", "nvme", "nvme"), (2, "bf16", "nvme", "none")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("deferred")
    return run_ranks(orr.deferred_copy_runs, 2, args=(CASES, str(root)), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_deferred_copies_train_exactly_like_plain_ones(results, case):
    for rank in results:
        plain, deferred = rank[case][False], rank[case][True]
        assert plain["copies"] == 0  # a CPU-only run issues no stream copies ...
        assert deferred["copies"] > 0  # ... and this one went through the side stream
        assert deferred["most_outstanding_ok"]
        for a, b in zip(plain["params"], deferred["params"]):
            assert torch.equal(a, b)
        assert plain["losses"] == deferred["losses"]


ONE_RANK = [(3, "bf16", "cpu", "cpu"), (3, "fp32", "nvme", "nvme")]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("deferred1")
    return run_ranks(orr.deferred_copy_runs, 1, args=(ONE_RANK, str(root)), timeout=300)[0]


@pytest.mark.parametrize("case", ONE_RANK, ids=lambda c: "-".join(map(str, c)))
def test_one_rank_copies_host_shards_into_the_gathered_buffer_and_waits_at_use(one_rank, case):
    """One rank: a host shard is copied straight into its gathered buffer, and compute waits for
    that copy only when the unit is used, so the copies prefetched ahead are still in flight while
    the modules before them compute (what lets them overlap on a GPU); training is unchanged."""
    plain, deferred = one_rank[case][False], one_rank[case][True]
    assert deferred["copies"] > 0 and deferred["most_outstanding_ok"]
    for a, b in zip(plain["params"], deferred["params"]):
        assert torch.equal(a, b)
    assert plain["losses"] == deferred["losses"]
    # A host shard on a CPU run lies where it is computed with: it is the gathered buffer itself
    # and nothing is copied ahead (the copies counted are the optimizer's). An NVMe shard is read
    # into memory first, so its copies run ahead as a host shard's do on an accelerator.
    stage, dtype, opt, param = case
    assert (deferred["most_ahead"] > 0) == (param == "nvme")
