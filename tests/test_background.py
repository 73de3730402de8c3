"""The session's background jobs (tests/background.py): a job's commands run in order and stop at the
first that fails, a fixture that asks for a job before it started runs it itself, a failure to start
reaches the fixture, a called function's value comes back, and the modules that wait for jobs run last."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from background import Background, Command, call, pytest_collection_modifyitems, returned


def _request(module: str, fixture: str, tmp_path_factory) -> SimpleNamespace:
    return SimpleNamespace(module=SimpleNamespace(__name__=module), fixturename=fixture,
                           getfixturevalue=lambda name: tmp_path_factory)


def _python(code: str) -> Command:
    return Command([sys.executable, "-S", "-c", code], timeout=60)  # -S: no site-packages, a quick start


def test_commands_stop_at_the_first_failure(tmp_path):
    jobs = Background()
    jobs.submit(("m", "f"), tmp_path, [_python("print('one')"), _python("import sys; sys.exit(3)"), _python("1")])
    jobs.start()
    root, done = jobs.wait(_request("m", "f", None))
    assert root == tmp_path
    assert [(p.returncode, p.stdout) for p in done] == [(0, "one\n"), (3, "")]


def test_a_job_not_started_runs_in_the_fixture_that_asks(tmp_path_factory):
    jobs = Background()  # never started: no thread takes the job
    jobs.submit(("m", "f"), tmp_path_factory.mktemp("job"), [_python("print(2 + 2)")])
    _, (proc,) = jobs.wait(_request("m", "f", tmp_path_factory))
    assert proc.stdout == "4\n"
    # a fixture whose module declared nothing at collection builds its job now
    _, (proc,) = jobs.wait(_request("m", "g", tmp_path_factory), lambda root: [_python("print(root := 5)")])
    assert proc.stdout == "5\n"


def test_a_command_that_cannot_start_fails_the_fixture(tmp_path):
    jobs = Background()
    jobs.submit(("m", "f"), tmp_path, [Command([str(tmp_path / "no-such-python")])])
    with pytest.raises(FileNotFoundError, match="no-such-python"):
        jobs.wait(_request("m", "f", None))


def test_a_called_function_returns_its_value_or_its_output(tmp_path):
    jobs = Background()
    jobs.submit(("m", "f"), tmp_path, [call(tmp_path, "composition:ranks", ("pipeline_dp", "tensor_parallel"))])
    assert returned(*jobs.wait(_request("m", "f", None))) == 8
    (tmp_path / "bad").mkdir()
    jobs.submit(("m", "g"), tmp_path / "bad", [call(tmp_path / "bad", "composition:no_such_function")])
    with pytest.raises(AssertionError, match="composition:no_such_function failed with exit code 1(.|\n)*AttributeError"):
        returned(*jobs.wait(_request("m", "g", None)))


def test_modules_that_wait_for_jobs_run_last_in_their_order():
    plain, waits = SimpleNamespace(), SimpleNamespace(BACKGROUND={"x": None})
    items = [SimpleNamespace(name=n, module=m) for n, m in
             [("a", plain), ("b", waits), ("c", waits), ("d", plain), ("e", SimpleNamespace())]]
    pytest_collection_modifyitems(None, None, items)
    assert [i.name for i in items] == ["a", "d", "e", "b", "c"]
