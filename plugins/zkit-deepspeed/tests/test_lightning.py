"""PyTorch Lightning's ``DeepSpeedStrategy`` (stages 2, 3 and 3 with CPU offload), unmodified, on
zkit through the ``deepspeed`` drop-in: ``lightning_flow.py`` trains, saves with
``trainer.save_checkpoint``, resumes and converts with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict``, here and in ``.venv-peers`` with the real
DeepSpeed 0.19.8; losses, resumed losses and converted weights must be DeepSpeed's."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from background import Command
import peer_env
from peer_env import PEER_PYTHON

pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")

HERE = Path(__file__).resolve().parent
FLOWS = ["deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
#: DeepSpeedCPUAdam (DeepSpeed's C++ kernel) against zkit's CPU Adam: equal to rounding (weights near
#: zero: to 1e-6 absolute)
RTOL = {"deepspeed_stage_3_offload": 1e-5}
#: what DeepSpeed's model file holds besides the client state that the drop-in's does not (Lightning keeps
#: them in its converted file): the parallel degrees, the frozen parameters' values and two features zkit
#: lacks (its ds_config, ds_version, buffer_names, param_shapes, frozen_param_shapes and shared_params are there)
DEEPSPEED_ONLY = {"checkpoint_parallel_dimensions", "data_sampler", "frozen_param_fragments", "random_ltd"}


def _command(python: str, out: Path) -> Command:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    # cwd: a directory with nothing named like a package in it
    return Command([python, str(HERE / "lightning_flow.py"), "--out", str(out), *FLOWS], env=env, cwd=str(out.parent),
                   timeout=600)


def _finish(proc, out: Path) -> dict:
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        raise AssertionError(f"lightning_flow.py failed ({proc.returncode}):\n" + "\n".join(text.splitlines()[-40:]))
    return json.loads((out / "results.json").read_text())


def _commands(root: Path) -> list[Command]:
    """zkit's run, then DeepSpeed's (where it fails, ``peer_env`` tells whether the environment is why)."""
    if not PEER_PYTHON.exists():
        return [_command(sys.executable, root / "zkit")]
    return [_command(sys.executable, root / "zkit"), _command(str(PEER_PYTHON), root / "deepspeed")]


#: run beside the other tests from the session's start (tests/background.py)
BACKGROUND = {"runs": _commands}
PEER_MISSING = f"{PEER_PYTHON} cannot import lightning and deepspeed (add lightning with `make peers`)"


@pytest.fixture(scope="module")
def runs(background, request) -> tuple[dict, dict | None]:
    root, done = background.wait(request)
    ours = _finish(done[0], root / "zkit")
    if len(done) < 2 or (done[1].returncode != 0 and peer_env.cannot_import("lightning", "deepspeed")):
        return ours, None  # no peer environment, or it cannot import both
    return ours, _finish(done[1], root / "deepspeed")


def test_both_sides_run_the_flows_and_no_probe(tmp_path):
    commands = _commands(tmp_path)
    assert [c.argv[0] for c in commands] == [sys.executable] + ([str(PEER_PYTHON)] if PEER_PYTHON.exists() else [])
    assert all(c.argv[1] == str(HERE / "lightning_flow.py") for c in commands)


def _close(a: list, b: list, rtol: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=rtol * 0.1) for x, y in zip(a, b))


def _flat(value) -> list[float]:
    return [x for item in value for x in _flat(item)] if isinstance(value, list) else [value]


@pytest.mark.parametrize("flow", FLOWS)
def test_lightning_trains_resumes_and_converts(runs, flow):
    ours = runs[0][flow]
    assert runs[0]["deepspeed"].endswith("+zkit")
    assert len(ours["losses"]) == 3 and len(ours["resumed"]) == 2 and ours["global_step"] == 3
    assert all(math.isfinite(x) for x in ours["losses"] + ours["resumed"])
    assert {"callbacks", "epoch", "global_step", "loops", "lr_schedulers", "pytorch-lightning_version"} <= \
        set(ours["client_keys"])


@pytest.mark.parametrize("flow", FLOWS)
def test_equal_to_real_deepspeed(runs, flow):
    if runs[1] is None:
        pytest.skip(f"no real DeepSpeed to compare with: {PEER_PYTHON} does not exist" if not PEER_PYTHON.exists()
                    else PEER_MISSING)
    ours, theirs = runs[0][flow], runs[1][flow]
    rtol = RTOL.get(flow, 0.0)
    assert _close(ours["losses"], theirs["losses"], rtol)
    assert _close(ours["resumed"], theirs["resumed"], rtol)
    assert list(ours["weights"]) == list(theirs["weights"])
    for name in theirs["weights"]:
        assert _close(_flat(ours["weights"][name]), _flat(theirs["weights"][name]), max(rtol, 1e-7)), name
    assert set(ours["client_keys"]) == set(theirs["client_keys"]) - DEEPSPEED_ONLY
