"""ZeRO-Offload's gradient path: with the optimizer offloaded to a host apart from the device,
stages 2-3 copy each reduced chunk out of its bucket into fp32 shards beside the master, and no
gradient shard is ever made on the device. On this CPU-only machine the host *is* the device, so
the path is taken by having the allocator answer as it does next to a GPU; it must train what the
device-shard path trains, on 2 gloo ranks, with and without gradient accumulation."""
import pytest

from zkit.testing import run_ranks

import offload_ranks as orr

CASES = [(2, "fp32", 1), (2, "fp32", 2), (3, "fp32", 1), (3, "fp32", 2), (2, "bf16", 2), (3, "fp16", 1)]


@pytest.fixture(scope="module")
def results():
    return run_ranks(orr.grads_beside_master_matrix, 2, args=(CASES,), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_grads_beside_the_master_train_as_device_shards_do(results, case):
    stage, dtype, gas = case
    for rank in results:
        base, beside = rank[(*case, False)], rank[(*case, True)]
        assert not base["beside"] and beside["beside"]
        # no device gradient shard was made; fp32 shards of the whole partition took their place
        assert beside["peak"].get("grad", 0) == 0 and beside["peak"]["master_grad"] > 0
        assert base["peak"]["grad"] > 0
        if dtype == "fp32":
            # the same fp32 sums in the same order: bit for bit
            assert orr.max_diff(beside["params"], base["params"]) == 0
            assert beside["losses"] == base["losses"]
        else:
            # fp32 accumulation on the host against the device's 16-bit one
            assert orr.max_diff(beside["params"], base["params"]) < orr.TOLERANCE[dtype]
        if gas == 1:  # (with accumulation the losses are of different micro-batches)
            assert beside["losses"][-1] < beside["losses"][0]
    assert orr.max_diff(results[0][(*case, True)]["params"], results[1][(*case, True)]["params"]) == 0
