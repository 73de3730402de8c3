"""zkit.testing runs real ranks and never lets a failure hang the caller."""
import time

import pytest

from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

import engine_ranks as er
from environment_ranks import getenvs, last_rank_uses_the_group_after_the_others_returned, rank_one_dies


def test_results_come_back_in_rank_order():
    assert run_ranks(er.rank_and_world, 3, timeout=120) == [(0, 3), (1, 3), (2, 3)]


def test_a_failing_rank_raises_with_its_traceback_promptly():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"rank 1 of fail_on_rank_one failed:(.|\n)*ValueError: rank one is broken"):
        run_ranks(er.fail_on_rank_one, 2, timeout=300)
    assert time.monotonic() - start < 120  # not the timeout


def test_a_rank_that_returned_keeps_the_group_open_until_every_rank_has():
    """Gloo connects a group's pairs while its ranks already run: a rank that exits as soon as it
    returns closes pairs under a slower rank still connecting them ('Connection closed by peer')."""
    fn = last_rank_uses_the_group_after_the_others_returned
    assert run_ranks(fn, 3, timeout=120) == [0, 1, 2]


@pytest.mark.parametrize("how, fate", [("SIGKILL", "was killed by signal SIGKILL"), ("exit 3", "died with exit code 3")])
def test_a_rank_that_dies_without_a_traceback_is_named_first_with_how_it_ended(how, fate):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(rank_one_dies, 3, args=(how,), timeout=120)
    report = str(failed.value)
    assert report.startswith(f"rank 1 of rank_one_dies {fate} and sent no traceback"), report
    # the others returned at once and wait for the rest before they close the group
    assert "rank 0 of rank_one_dies returned its result" in report and "rank 2 of rank_one_dies returned its result" in report


def test_a_hang_ends_at_the_timeout_naming_the_ranks():
    with pytest.raises(RanksTimedOut, match=r"hang on 2 ranks did not finish within 8 s; ranks still running: \[0, 1\]"):
        run_ranks(er.hang, 2, timeout=8)


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_as_of_the_call(monkeypatch, start):
    """A forked rank would otherwise see the forkserver's environment, frozen when it started."""
    monkeypatch.setenv("ZKIT_RANKS_START", start)
    monkeypatch.setenv("ZKIT_PROBE_SET", "now")
    monkeypatch.delenv("ZKIT_PROBE_GONE", raising=False)
    # two process groups instead of four: each start of a spawned rank imports torch again
    assert run_ranks(getenvs, 2, args=("ZKIT_PROBE_SET", "ZKIT_PROBE_GONE"), timeout=120) == [["now", None]] * 2
    # the caller's env= and threads_per_rank, each over the caller's environment
    assert run_ranks(getenvs, 1, args=("ZKIT_PROBE_SET", "OMP_NUM_THREADS"), env={"ZKIT_PROBE_SET": "mine"},
                     threads_per_rank=2, timeout=120) == [["mine", "2"]]


def test_an_unknown_start_method_is_named(monkeypatch):
    monkeypatch.setenv("ZKIT_RANKS_START", "fork")
    with pytest.raises(ValueError, match="ZKIT_RANKS_START must be 'spawn' or 'forkserver', got 'fork'"):
        run_ranks(er.rank_and_world, 1)
    with pytest.raises(ValueError, match=r"run_ranks\(start=...\) must be 'spawn' or 'forkserver', got 'thread'"):
        run_ranks(er.rank_and_world, 1, start="thread")
