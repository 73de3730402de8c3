"""zkit.testing runs real ranks and never lets a failure hang the caller."""
import time

import pytest

from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

import engine_ranks as er


def test_results_come_back_in_rank_order():
    assert run_ranks(er.rank_and_world, 3, timeout=120) == [(0, 3), (1, 3), (2, 3)]


def test_a_failing_rank_raises_with_its_traceback_promptly():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"rank 1 of fail_on_rank_one failed:(.|\n)*ValueError: rank one is broken"):
        run_ranks(er.fail_on_rank_one, 2, timeout=300)
    assert time.monotonic() - start < 120  # not the timeout


def test_a_hang_ends_at_the_timeout_naming_the_ranks():
    with pytest.raises(RanksTimedOut, match=r"hang on 2 ranks did not finish within 8 s; ranks still running: \[0, 1\]"):
        run_ranks(er.hang, 2, timeout=8)
