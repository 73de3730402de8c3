"""Long runs that fixtures wait for, started in processes of their own when the session starts.

Most tests run in pytest's own process, one core busy of two; a module's long runs (the real
DeepSpeed's reference runs, the Hugging Face and Lightning flows, the composition matrix) can use
the other core meanwhile. A test module declares them::

    def _peer_commands(root: Path) -> list[Command]: ...
    BACKGROUND = {"peer_results": _peer_commands}   # fixture name -> its commands

and the fixture collects them with ``root, done = background.wait(request)``: ``done`` holds one
``subprocess.CompletedProcess`` per command run, in order; the commands after one that failed are
not run (:func:`call` runs a function of ``tests/`` in a fresh interpreter, :func:`returned` gives
what it returned). The modules that declare jobs run after all the others. When the session
starts, the jobs of the fixtures that the collected tests use are queued and run one at a time, in
test order, by one thread; a fixture whose job has not started yet runs it itself at once. The
commands and their environments are built before any test runs, so that no test's ``monkeypatch``
leaks into them. A job's outcome does not depend on when it ran: it is a process of its own.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest


@dataclass(frozen=True)
class Command:
    """A process to run: its arguments, its environment (this process's when the command is built),
    its working directory and the seconds it may take."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str | None = None
    timeout: float = 900.0


TESTS = os.path.dirname(os.path.abspath(__file__))
_CALL = ("import importlib, pickle, sys; sys.path.insert(0, sys.argv[1]); module, name = sys.argv[2].split(':'); "
         "value = getattr(importlib.import_module(module), name)(*pickle.loads(bytes.fromhex(sys.argv[3]))); "
         "open(sys.argv[4], 'wb').write(pickle.dumps(value))")


def call(root: Path, target: str, *args, timeout: float = 1800.0) -> Command:
    """A fresh interpreter that calls ``target`` (``"module:function"``, found on ``tests/``'s path)
    with ``args`` and pickles what it returns for :func:`returned`."""
    return Command([sys.executable, "-c", _CALL, TESTS, target, pickle.dumps(args).hex(), str(root / "returned.pickle")],
                   timeout=timeout)


def returned(root: Path, done: list[subprocess.CompletedProcess]):
    """What the function of a :func:`call` job returned; its output when it failed."""
    (proc,) = done
    if proc.returncode != 0:
        raise AssertionError(f"{proc.args[4]} failed with exit code {proc.returncode}:\n"
                             + "\n".join((proc.stdout + proc.stderr).splitlines()[-60:]))
    return pickle.loads((root / "returned.pickle").read_bytes())


class _Job:
    def __init__(self, root: Path, commands: list[Command]) -> None:
        self.root, self.commands = root, commands
        self.state = "queued"  # then "running", then "done"
        self.done: list[subprocess.CompletedProcess] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.seconds: list[float] = []  # each command's wall time, for the session's summary

    def run(self) -> None:
        try:
            for c in self.commands:
                started = time.monotonic()
                self.proc = subprocess.Popen(c.argv, env=c.env, cwd=c.cwd, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
                try:
                    out, err = self.proc.communicate(timeout=c.timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    out, err = self.proc.communicate()
                    raise AssertionError(f"{' '.join(c.argv[:4])} ... did not finish within {c.timeout:.0f} s:\n"
                                         + "\n".join((out + err).splitlines()[-40:])) from None
                self.seconds.append(time.monotonic() - started)
                self.done.append(subprocess.CompletedProcess(c.argv, self.proc.returncode, out, err))
                if self.proc.returncode != 0:
                    break
        except BaseException as exc:  # noqa: BLE001 - given to the fixture that waits
            self.error = exc
        finally:
            self.state = "done"
            self.finished.set()


class Background:
    """The session's background jobs, keyed by (module, fixture name)."""

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._order: list[_Job] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, key: tuple[str, str], root: Path, commands: list[Command]) -> None:
        job = _Job(root, commands)
        self._jobs[key] = job
        self._order.append(job)

    def start(self) -> None:
        if self._order and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="background-jobs", daemon=True)
            self._thread.start()

    def _take(self, job: _Job) -> bool:
        with self._lock:
            if job.state != "queued" or self._closed:
                return False
            job.state = "running"
            return True

    def _work(self) -> None:
        for job in self._order:
            if self._take(job):
                job.run()

    def wait(self, request: pytest.FixtureRequest, make: Callable[[Path], list[Command]] | None = None,
             ) -> tuple[Path, list[subprocess.CompletedProcess]]:
        """The job of ``request``'s fixture, run here if it was not started (or not queued: ``make``,
        else the module's ``BACKGROUND`` entry, builds it now)."""
        key = (request.module.__name__, request.fixturename)
        if key not in self._jobs:
            make = make or request.module.BACKGROUND[request.fixturename]
            root = request.getfixturevalue("tmp_path_factory").mktemp(request.fixturename)
            self.submit(key, root, make(root))
        job = self._jobs[key]
        if self._take(job):
            job.run()
        job.finished.wait()
        if job.error is not None:
            raise job.error
        return job.root, job.done

    def timings(self) -> list[str]:
        """One line per job that ran: its fixture, its total and each command's seconds."""
        return [f"{sum(job.seconds):7.1f} s  {module}::{name}  ("
                + ", ".join(f"{s:.1f}" for s in job.seconds) + ")"
                for (module, name), job in self._jobs.items() if job.state == "done"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for job in self._order:
            if job.state == "running" and job.proc is not None and job.proc.poll() is None:
                job.proc.kill()


_BACKGROUND = Background()


def pytest_collection_modifyitems(session, config, items) -> None:
    """The modules that wait for background jobs run last (in their order): their jobs then have the
    whole session to finish in."""
    waits = [item for item in items if getattr(getattr(item, "module", None), "BACKGROUND", None)]
    if waits:
        waiting = set(map(id, waits))
        items[:] = [item for item in items if id(item) not in waiting] + waits


def pytest_terminal_summary(terminalreporter) -> None:
    """The background jobs' own durations: with the foreground's ``--durations``, which side of the
    session is its longest."""
    lines = _BACKGROUND.timings()
    if lines:
        terminalreporter.write_sep("=", "background jobs (seconds per command)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def background() -> Background:
    return _BACKGROUND


@pytest.fixture(scope="session", autouse=True)
def _start_background_jobs(request, tmp_path_factory):
    """Queue the jobs of the fixtures the collected tests use, in test order, and start them."""
    seen = set()
    for item in request.session.items:
        module = getattr(item, "module", None)
        for name, make in getattr(module, "BACKGROUND", {}).items():
            key = (module.__name__, name)
            if key in seen or name not in getattr(item, "fixturenames", ()):
                continue
            seen.add(key)
            root = tmp_path_factory.mktemp(name)
            try:
                commands = make(root)
            except Exception:  # noqa: BLE001 - the fixture builds it again and reports the error
                continue
            _BACKGROUND.submit(key, root, commands)
    _BACKGROUND.start()
    yield
    _BACKGROUND.close()
