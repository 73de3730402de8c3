"""``offload_optimizer.step_in_backward``: each sub-group steps during the backward that ends a
batch, as soon as its gradients are complete.

On 2 gloo ranks, at stages 2 and 3 (parameters on NVMe too), fp32 and bf16, with and without
gradient accumulation, the run equals the same run stepping after backward bit for bit, and moves
exactly the gradients' round trip less through the optimizer's swap files. A non-finite loss stops
the job at ``step()`` with the reason; what cannot be honoured is refused at initialize.
"""
import pytest

import zkit
from zkit.testing import run_ranks

import offload_ranks as orr
import step_in_backward_ranks as sr

CASES = [(2, "fp32", 1, "none"), (2, "bf16", 2, "none"), (3, "fp32", 2, "none"), (3, "bf16", 1, "nvme")]
STEPS = 3


@pytest.fixture(scope="module")
def nvme_root(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def results(nvme_root):
    return run_ranks(sr.equivalence, 2, args=(CASES, str(nvme_root), STEPS), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_stepping_in_backward_changes_nothing_but_the_time(results, case):
    for rank in results:
        after, during = rank[case + (False,)], rank[case + (True,)]
        assert orr.max_diff(during["params"], after["params"]) == 0
        assert during["losses"] == after["losses"]
        assert during["began"] == [True] * STEPS and after["began"] == [False] * STEPS


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_gradients_round_trip_through_the_disk_is_saved(results, case):
    """After the first step: per step, the gradient shards are not written (their bytes) and the
    sub-groups' gradient files are not read back (their bytes, alignment included)."""
    steps = STEPS - 1
    for rank in results:
        after, during = rank[case + (False,)], rank[case + (True,)]
        assert after["written"] - during["written"] == steps * after["grad_bytes"]
        assert after["read"] - during["read"] == steps * after["subgroup_bytes"]


def test_a_nonfinite_loss_stops_the_job_with_the_reason(tmp_path):
    for message in run_ranks(sr.nonfinite_stops, 2, args=(str(tmp_path),), timeout=120):
        assert "step_in_backward" in message and "cannot be skipped" in message and "NaN or infinite" in message


@pytest.mark.parametrize("change, words", [
    ({"gradient_clipping": 1.0}, ("step_in_backward", "gradient_clipping 1.0")),
    ({"fp16": {"enabled": True}}, ("step_in_backward", "fp16.enabled")),
    ({"zero_optimization.stage": 1}, ("step_in_backward", "stage 2 or 3", "stage 1")),
    ({"zero_optimization.offload_optimizer.device": "none"}, ("step_in_backward", "needs device 'cpu' or 'nvme'",
                                                              "'none'")),
])
def test_what_it_cannot_honour_is_refused_at_initialize(tmp_path, change, words):
    cfg = sr.sib_config(2, "fp32", 1, str(tmp_path), True)
    for key, value in change.items():
        *path, last = key.split(".")
        section = cfg
        for name in path:
            section = section[name]
        section[last] = value
    with pytest.raises(Exception) as info:
        zkit.initialize(model=orr.make_model(), config=cfg)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_second_backward_before_step_is_an_error(tmp_path):
    engine, *_ = zkit.initialize(model=orr.make_model(), config=sr.sib_config(2, "fp32", 1, str(tmp_path), True))
    try:
        ids, labels = orr.global_batches(1, 2)
        loss = engine(ids[:2], labels[:2])
        engine.backward(loss, retain_graph=True)
        with pytest.raises(RuntimeError) as info:
            engine.backward(loss)
        assert "step_in_backward: a second backward ends the batch before step()" in str(info.value)
    finally:
        engine.close()
