"""``zkit run``'s failure summary names the rank that caused a failure, not one that followed from it."""
import subprocess
import sys
import textwrap

# Rank 1 is slow and then raises; rank 0, waiting for it in a collective, times out first (a
# secondary error) and stays alive a moment, so rank 1's exception comes in a later second than
# rank 0's failure: torchrun, which stamps failures in whole seconds, observes rank 0's first.
_ROOT_CAUSE_LATER = """
import atexit, datetime, os, sys, time
import torch, torch.distributed as dist
from zkit.core import distributed
marker = os.path.join(sys.argv[1], "rank0_failed")
distributed.ensure_initialized()
dist.barrier()  # the mesh is whole; the ranks enter new_group together
group = dist.new_group(timeout=datetime.timedelta(seconds=3))
if dist.get_rank() == 0:
    atexit.register(lambda: (open(marker, "w").close(), time.sleep(60)))  # after its error is recorded
    dist.all_reduce(torch.ones(1), group=group)  # rank 1 never joins: this times out
else:
    while not os.path.exists(marker):
        time.sleep(0.05)
    time.sleep(1.1)
    raise ValueError("shard 3 of the dataset is missing")
"""


def test_the_summary_names_the_raising_rank_not_the_one_that_timed_out_first(tmp_path):
    script = tmp_path / "late_cause.py"
    script.write_text(textwrap.dedent(_ROOT_CAUSE_LATER))
    out = subprocess.run([sys.executable, "-m", "zkit.cli", "run", "--nproc", "2", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0
    summary = out.stderr[out.stderr.lower().find("root cause"):]
    cause = summary.find("ValueError: shard 3 of the dataset is missing")
    assert cause != -1, out.stderr[-4000:]
    assert "Timed out waiting" not in summary[:cause], summary
    assert "Timed out waiting" in summary[cause:], summary  # rank 0 is listed after, as following from it
    assert summary.startswith("Root cause: rank 1 (local_rank 1, pid ")
    assert "follows from the root cause:\n    RuntimeError: " in summary
    assert "failed (exitcode" not in out.stderr  # torchrun's line naming its first observed failure


def _failure(tmp_path, rank, exitcode, traceback=None, timestamp=1_700_000_000):
    """torchrun's record of a failed rank, read from an error file as ``@record`` writes it."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{rank}.json"
    if traceback is not None:
        path.write_text(json.dumps({"message": {"message": traceback.splitlines()[-1], "extraInfo": {
            "py_callstack": traceback, "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def _traceback(error: str) -> str:
    return f'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n    step()\n{error}\n'


_CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4321"


def test_an_own_error_in_the_same_second_as_a_secondary_one_is_the_root_cause(tmp_path):
    from zkit.rank_failures import failure_summary, root_cause_rank

    failures = {0: _failure(tmp_path, 0, 1, _traceback(_CLOSED)),
                1: _failure(tmp_path, 1, 1, _traceback("ValueError: bad batch"))}
    text = failure_summary(failures)
    assert root_cause_rank(failures) == 1
    root = text.index("Root cause: rank 1 (local_rank 1, pid 1001), exit code 1, at ")
    assert text.index("ValueError: bad batch") > root and text.index("    step()") > root
    assert "rank 0 (local_rank 0, pid 1000), exit code 1, at " in text
    assert f"follows from the root cause:\n    {_CLOSED}" in text


def test_a_rank_killed_without_a_traceback_is_the_root_cause_of_its_peers_connection_errors(tmp_path):
    from zkit.rank_failures import failure_summary

    failures = {0: _failure(tmp_path, 0, 1, _traceback(_CLOSED)),
                1: _failure(tmp_path, 1, -9)}  # an out-of-memory kill, stamped when torchrun saw it: later
    text = failure_summary(failures)
    assert "Root cause: rank 1 (local_rank 1, pid 1001), killed by SIGKILL, at " in text
    assert "(no traceback recorded: see the rank's output above)" in text
    assert text.index("Root cause: rank 1") < text.index(_CLOSED)


def test_when_every_failure_is_secondary_the_summary_says_so(tmp_path):
    from zkit.rank_failures import failure_summary

    timeout = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
    failures = {0: _failure(tmp_path, 0, 1, _traceback(timeout)), 1: _failure(tmp_path, 1, -15)}
    text = failure_summary(failures)
    assert "Root cause: none recorded here. Every failed rank failed with a connection error or timeout" in text
    assert "the earliest: rank 0 (local_rank 0, pid 1000), exit code 1, at " in text
    assert "rank 1 (local_rank 1, pid 1001), killed by SIGTERM, at " in text and "; stopped by the launcher" in text


def test_run_ranks_and_zkit_run_share_one_definition_of_secondary():
    import zkit.testing
    from zkit.rank_failures import SECONDARY_ERRORS, is_secondary

    assert zkit.testing.is_secondary is is_secondary
    assert all(is_secondary(f"RuntimeError: {marker}") for marker in SECONDARY_ERRORS)
    assert not is_secondary("ValueError: shard 3 of the dataset is missing")
