"""Checks of the ZeRO benchmark's own logic (no training): formulas, option errors, result merging,
the goal test, the memory guard and the scale plots. ``pytest contrib/bench/zero_bench_test.py``
(a few seconds)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_zero  # noqa: E402
import zero_formulas  # noqa: E402
import zero_scale  # noqa: E402
from zero_workloads import RssGuard, Workload  # noqa: E402

psis = st.integers(min_value=1, max_value=10**12)
worlds = st.integers(min_value=1, max_value=4096)


@given(psis)
def test_one_rank_holds_everything_at_every_stage(psi):
    assert {zero_formulas.model_state_bytes(s, psi, 1) for s in range(4)} == {16.0 * psi}


@given(psis, st.integers(min_value=2, max_value=4096))
def test_each_stage_holds_less_than_the_one_before(psi, n):
    held = [zero_formulas.model_state_bytes(s, psi, n) for s in range(4)]
    assert held == sorted(held, reverse=True) and len(set(held)) == 4


@given(psis, worlds, st.sampled_from([2, 4]))
def test_ring_traffic_is_the_papers_volume_times_n_minus_1_over_n(psi, n, elt):
    for s in range(4):
        ring = zero_formulas.ring_traffic_bytes(s, psi, n, elt)
        assert ring == pytest.approx(zero_formulas.traffic_elements(s, psi) * elt * (n - 1) / n)


def test_unknown_stage_is_an_error_naming_it():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        zero_formulas.model_state_bytes(4, 10, 2)
    with pytest.raises(ValueError, match="got -1"):
        zero_formulas.traffic_elements(-1, 10)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtypes", "fp8"], "dtypes must be among fp32, bf16, fp16, got 'fp8'"),
        (["--skip", "memory,disk"], "--skip takes memory and/or speed, got disk"),
        (["--memory-worlds", "2,0"], "expected positive integers, got '2,0'"),
        (["--memory-worlds", "two"], "expected comma-separated integers, got 'two'"),
        (["--rounds", "0"], "must be a positive integer, got '0'"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--deepspeed-python", "/nonexistent/python"], "--deepspeed-python /nonexistent/python does not exist"),
    ],
)
def test_bad_options_are_errors_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_zero.parse_args(argv)
    assert message in capsys.readouterr().err


def test_merge_takes_the_slowest_rank_per_step_and_keeps_errors():
    per_rank = [{"a": [1.0, 5.0], "b": "RuntimeError: boom"}, {"a": [2.0, 3.0], "b": "RuntimeError: boom"}]
    assert bench_zero.merge_ranks(per_rank) == {"a": [2.0, 5.0], "b": "RuntimeError: boom"}
    assert bench_zero.merge_ranks("rank 1 died", ["a"]) == {"a": "rank 1 died"}


def _info(held: int, bucket: int = 0) -> dict:
    return {"state": {"param": held}, "bucket_peak": bucket, "comm": {}}


def test_goal_is_five_percent_over_the_formula_plus_one_bucket():
    psi, n, bucket = 1000, 2, 100
    formula = zero_formulas.model_state_bytes(2, psi, n)
    assert bench_zero.state_cells(2, psi, n, _info(int(1.05 * formula) + bucket, bucket), bucket)[1] is True
    assert bench_zero.state_cells(2, psi, n, _info(int(1.05 * formula) + bucket + 1), bucket)[1] is False
    assert bench_zero.state_cells(2, psi, n, "failed", bucket) == ("n/a", None)


def test_scale_search_stops_before_a_size_predicted_over_the_cap():
    sizes = zero_scale.ladder((2, 64))
    ran = []

    def run(w):
        ran.append(w.n_layer)
        return [{"times": [1.0, 2.0, 3.0], "peak_rss": 10}]

    cap = int(zero_scale.predicted_bytes(0, sizes[0].num_parameters(), 4)) + 1
    attempts = zero_scale.search("x", 0, run, cap, 4, sizes, lambda _: None)
    assert ran == [2]
    assert [a.ok for a in attempts] == [True, False]
    assert attempts[1].note == "predicted over cap, not started"
    assert attempts[0].step_s == 2.0


def test_failure_note_recognises_the_memory_guard():
    assert zero_scale.failure_note("rank 2 of f died with exit code 86 and no traceback") == "over the memory cap"
    assert zero_scale.failure_note("x\nValueError: bad size\n") == "ValueError: bad size"


def test_rss_guard_stops_a_process_that_outgrows_its_cap():
    code = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from zero_workloads import RssGuard, rss_bytes\n"
        "g = RssGuard(rss_bytes() + 64 * 2**20, period_s=0.01)\n"
        "blob = bytearray(256 * 2**20)\n"
        "time.sleep(2)\n" % os.path.dirname(os.path.abspath(__file__))
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == RssGuard.OVER_CAP_EXIT
    assert "resident set over" in proc.stderr


def test_workload_round_trips_through_json():
    w = Workload(n_layer=3, dtype="bf16")
    assert Workload.from_json(w.to_json()) == w
    assert w.gpt_config().n_layer == 3


def test_phase_table_shows_medians_in_ms_and_leaves_torch_collectives_blank():
    from zero_phases import COLUMNS, FAULTS, phase_table

    zkit_steps = {c: [0.010, 0.030, 0.020] for c in COLUMNS} | {FAULTS: [1000, 3000, 2000]}
    torch_steps = {c: [0.5] for c in COLUMNS} | {FAULTS: [0]}
    text = phase_table([{"zkit ZeRO-3": zkit_steps, "torch DDP": torch_steps}], ["zkit ZeRO-3", "torch DDP"])
    header, _, zkit_row, torch_row = text.splitlines()
    assert header.split()[:4] == ["contestant", "rank", "forward", "ms"]
    assert zkit_row.split() == ["zkit", "ZeRO-3", "0", *["20"] * len(COLUMNS), "2.0"]
    assert torch_row.split() == ["torch", "DDP", "0", "500", "500", "500", "500", "0.0"]


def test_scale_plot_draws_each_contestant_or_says_why_not(tmp_path):
    sizes = zero_scale.ladder((2, 4, 6))
    attempts = [zero_scale.Attempt(sizes[0], True, step_s=1.0, peak_rss_total=2**30),
                zero_scale.Attempt(sizes[1], True, step_s=2.0, peak_rss_total=2 * 2**30),
                zero_scale.Attempt(sizes[2], False, "over the memory cap")]
    path = tmp_path / "scale.png"
    said = zero_scale.plot([("zkit ZeRO-3", 3, attempts)], {3: sizes[2].num_parameters()}, 3 * 2**30, 4, str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert said == "no plot: matplotlib is not installed (pip install matplotlib)"
        assert not path.exists()
        return
    assert said == f"plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_scale_reports_a_step_after_the_first():
    """The first step creates the optimizer state (with NVMe it reads no moments): never reported
    when later steps exist; of later steps the median, the slower of two."""
    from bench_offload_scale import steady_step

    assert steady_step([9.0, 1.0, 2.0]) == 2  # the first step was the median of all three
    assert steady_step([0.5, 3.0, 2.0, 1.0]) == 2  # the median of 3.0, 2.0 and 1.0
    assert steady_step([4.0]) == 0


def test_offload_scale_series_orders_the_sizes_that_trained_and_names_the_smallest_failure():
    import bench_offload_scale

    tried = [(1, {"ok": True, "params": 21, "times": [3.0, 1.0, 2.0], "cgroup_peak": 5}),
             (8, {"ok": False, "note": "killed at the memory cap"}),
             (4, {"ok": False, "note": "killed at the memory cap"}),
             (2, {"ok": True, "params": 34, "times": [2.0, 2.5, 2.0], "cgroup_peak": 7})]
    series = bench_offload_scale.size_series("torch", tried, 1024)
    assert series.points == [(21, 2.0, 5), (34, 2.5, 7)]  # by size, the slower of the steps after the first
    assert series.failed_at == bench_offload_scale.gpt_config(4, 1024).num_parameters()
