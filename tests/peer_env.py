"""The peer environment (``.venv-peers``, built by ``make peers``): the real DeepSpeed and the
libraries that run beside it in the comparisons.

A peer run imports what it needs itself, so no process is started just to see whether the peer
environment works: only after a peer run failed does a fixture ask :func:`cannot_import` whether
that is because the environment lacks a module (then it skips) or because the run itself broke
(then it fails). One probe process answers for every module and every fixture of the session."""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

PEER_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peers" / "bin" / "python"
#: what the peer runs import: probed together, once
MODULES = ("deepspeed", "transformers", "accelerate", "lightning")
_PROBE = ("import json, sys, traceback\n"
          "errors = {}\n"
          "for name in sys.argv[1:]:\n"
          "    try:\n"
          "        __import__(name)\n"
          "    except BaseException as exc:\n"
          "        errors[name] = traceback.format_exception_only(type(exc), exc)[-1].strip()\n"
          "print(json.dumps(errors))\n")


def environment(**extra: str) -> dict[str, str]:
    """The environment of a peer process: this one's without ``PYTHONPATH`` (it would put zkit's
    ``deepspeed`` first), DeepSpeed on the CPU, one thread, no warnings."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


@functools.cache
def import_errors(python: str = str(PEER_PYTHON), modules: tuple[str, ...] = MODULES) -> dict[str, str]:
    """The modules of ``modules`` that ``python`` cannot import, each with the last line of its error."""
    proc = subprocess.run([python, "-c", _PROBE, *modules], env=environment(), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:  # the interpreter itself died: every module gets its last words
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return dict.fromkeys(modules, last)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cannot_import(*modules: str, python: str = str(PEER_PYTHON)) -> str | None:
    """The error line of the first of ``modules`` the peer interpreter cannot import; None when it
    imports them all."""
    errors = import_errors(python, tuple(dict.fromkeys(MODULES + modules)))
    return next((errors[m] for m in modules if m in errors), None)


def wait_for_peer_runs(background, request, *modules: str):
    """``(root, done)`` of the background peer runs of ``request``'s fixture (tests/background.py);
    the test is skipped when the peer environment is missing, or when a run failed because it
    cannot import one of ``modules``."""
    import pytest

    if not PEER_PYTHON.exists():
        pytest.skip(f"no real DeepSpeed to compare with: {PEER_PYTHON} does not exist")
    root, done = background.wait(request)
    if any(proc.returncode != 0 for proc in done) and (last := cannot_import(*modules)):
        pytest.skip(f"no real DeepSpeed to compare with: {PEER_PYTHON} cannot import {modules[0]} ({last})")
    return root, done
