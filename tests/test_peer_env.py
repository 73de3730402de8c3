"""The peer environment's probe (tests/peer_env.py): one process answers which modules the peer
interpreter cannot import, a peer job's failure becomes a skip only when the environment is why,
and no background job starts a process just to probe."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import peer_env
import test_deepspeed_checkpoint_import as checkpoint_import
from peer_env import PEER_PYTHON


def test_import_errors_name_each_module_that_does_not_import_with_its_error():
    errors = peer_env.import_errors(sys.executable, ("json", "zkit_no_such_module", "os"))
    assert errors == {"zkit_no_such_module": "ModuleNotFoundError: No module named 'zkit_no_such_module'"}


def test_cannot_import_gives_the_first_missing_module_in_order(monkeypatch):
    monkeypatch.setattr(peer_env, "import_errors", lambda python, modules: {"accelerate": "A", "lightning": "L"})
    assert peer_env.cannot_import("deepspeed", "lightning", "accelerate") == "L"
    assert peer_env.cannot_import("deepspeed") is None


def _failed_job(tmp_path):
    failed = subprocess.CompletedProcess([str(PEER_PYTHON), "deepspeed_peer_run.py"], 1, "", "Traceback ...")
    return SimpleNamespace(wait=lambda request: (tmp_path, [failed]))


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=f"no DeepSpeed peer environment at {PEER_PYTHON}")
def test_a_failed_peer_job_skips_only_when_deepspeed_does_not_import(tmp_path, monkeypatch):
    missing = "ModuleNotFoundError: No module named 'deepspeed'"
    monkeypatch.setattr(peer_env, "cannot_import", lambda *modules: missing if "deepspeed" in modules else None)
    with pytest.raises(pytest.skip.Exception) as skipped:
        checkpoint_import.peer_job(_failed_job(tmp_path), None)
    assert str(skipped.value) == f"{PEER_PYTHON} cannot import deepspeed: {[missing]}"
    monkeypatch.setattr(peer_env, "cannot_import", lambda *modules: None)
    with pytest.raises(AssertionError, match=r"DeepSpeed's side \(deepspeed_peer_run.py\) failed with exit code 1"):
        checkpoint_import.peer_job(_failed_job(tmp_path), None)


def test_a_peer_job_runs_its_scripts_and_no_probe(tmp_path):
    commands = checkpoint_import.BACKGROUND["deepspeed_run"](tmp_path)
    assert [c.argv[1].rsplit("/", 1)[-1] for c in commands] == (
        ["deepspeed_peer_run.py", "deepspeed_peer_zero_to_fp32.py"] if PEER_PYTHON.exists() else [])
