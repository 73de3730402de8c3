"""ZeRO-Offload overlapped (``offload_optimizer.step_in_backward`` with device ``cpu``): each unit's
host step runs during the backward that ends a batch, as soon as its gradients have arrived.

On 1 and 2 gloo ranks, at stages 2 and 3, fp32 and bf16, with and without gradient accumulation,
and with a step skipped for a NaN gradient on one rank (after the units before it have stepped),
the run equals the same run stepping after backward bit for bit: parameters, optimizer state,
losses. Under the fake-stream backend every unit's host step runs after its gradient's copy has
run and before its parameters' copy is issued, while backward still delivers later units. What
cannot be honoured is refused at initialize, naming both keys.
"""
import pytest

from zkit.testing import run_ranks

import host_overlap_ranks as hr
import offload_ranks as orr

CASES = [(2, "fp32", 1, None), (2, "bf16", 1, None), (2, "bf16", 2, None), (2, "fp32", 1, 1), (2, "bf16", 2, 1),
         (3, "bf16", 1, 1), (3, "fp32", 2, None)]
STEPS = 3


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def results(request):
    return run_ranks(hr.equivalence, request.param, args=(CASES, STEPS), timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_stepping_in_backward_equals_the_step_after_it(results, case):
    for rank in results:
        after, during = rank[case + (False,)], rank[case + (True,)]
        assert during["store"] == "HostMasterStore" and after["store"] == "InMemoryMasterStore"
        assert during["began"] == [True] * STEPS and after["began"] == [False] * STEPS
        expected = [i != case[3] for i in range(STEPS)]
        assert during["applied"] == after["applied"] == expected
        assert during["losses"] == after["losses"]
        assert orr.max_diff(during["params"], after["params"]) == 0
        assert len(during["state"]) == len(after["state"]) and orr.max_diff(during["state"], after["state"]) == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_under_fake_streams_each_unit_steps_after_its_gradient_landed_and_returns_after_its_step(dtype):
    (r,) = run_ranks(hr.ordered_under_fake_streams, 1, args=(dtype,), timeout=300)
    assert r["losses"] == r["plain_losses"] and orr.max_diff(r["params"], r["plain_params"]) == 0
    units = r["units"]
    assert units > 2
    for events in r["batches"]:
        grads = {u: (i, issued) for i, (kind, u, issued) in enumerate(events) if kind == "grad"}
        steps = {u: (i, ran) for i, (kind, u, ran) in enumerate(events) if kind == "step"}
        params = {u: i for i, (kind, u, _) in enumerate(events) if kind == "param"}
        assert sorted(grads) == sorted(steps) == list(range(units))
        for u in range(units):
            at, copy_index = grads[u]
            step_at, copies_run = steps[u]
            if r["in_place"]:  # fp32 on the CPU: the parameters and their gradient buffers themselves
                assert step_at > at and copy_index is None and u not in params, (u, events)
                continue
            # the host step came after its gradient's copy was issued and after that copy had run
            assert step_at > at and copies_run > copy_index, (u, events)
            if r["copy_out"]:  # bf16 in host memory: the step's own pass wrote the parameters
                assert u not in params
            else:  # the parameters' copy is issued after the step, not before
                assert params[u] > step_at, (u, events)
        # overlapped: the first unit stepped before the last unit's gradient arrived, and was
        # handed over before backward reached its last op (the embedding lookup)
        assert steps[0][0] < grads[units - 1][0]
        assert grads[0][0] < events.index(("embedding", -1, None)), events
    assert r["copy_out"] == (dtype == "bf16")
    # fp32 on a CPU-only run copies nothing: the step works on the parameters and the gradient
    # buffers backward wrote, as the step after backward does
    assert r["in_place"] == (dtype == "fp32") and (r["copies"] == 0) == (dtype == "fp32")


@pytest.mark.parametrize("change, words", [
    ({"gradient_clipping": 1.0}, ("step_in_backward", "gradient_clipping 1.0", "steps each unit before")),
    ({"fp16": {"enabled": True}}, ("step_in_backward", "fp16.enabled", "steps each unit before")),
    ({"zero_optimization.stage": 1}, ("step_in_backward", "stage 2 or 3", "stage 1")),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, ("step_in_backward", "fused CPU optimizers", "SGD")),
])
def test_what_it_cannot_honour_is_refused_at_initialize(change, words):
    (message,) = run_ranks(hr.refusal, 1, args=(change,), timeout=120)
    assert all(w in message for w in words), message
