"""Hugging Face Trainer and Accelerate, unmodified, on zkit through the ``deepspeed`` drop-in.

``hf_flows.py`` runs once on 2 CPU ranks with this environment's ``deepspeed`` (the drop-in) and,
when ``.venv-peers`` holds a real DeepSpeed, once more there; every flow's losses must equal the
real DeepSpeed's within 1e-4 relative (fp32, dropout off, same data order). Without the peer
environment the zkit side still runs and checks what needs no reference: resume continues the
losses exactly, the saved weights are finite and the learning-rate schedule is transformers'.
"""
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

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
FLOWS = [
    "trainer:gpt2:0", "trainer:gpt2:2", "trainer:gpt2:3",
    "trainer:bert:0", "trainer:bert:2", "trainer:bert:3",
    "trainer_own:gpt2:2", "trainer_own:bert:3",
    "accelerate:gpt2:0", "accelerate:gpt2:2", "accelerate:gpt2:3", "accelerate:bert:3",
]
#: `accelerate launch` configures the DeepSpeed plugin from its flags (one more process launch)
LAUNCHED = "launch:gpt2:3"
LAUNCH_FLAGS = ["--use_deepspeed", "--num_processes", "2", "--num_machines", "1", "--zero_stage", "3",
                "--zero3_init_flag", "true", "--zero3_save_16bit_model", "true", "--gradient_accumulation_steps",
                "2", "--mixed_precision", "no", "--dynamo_backend", "no"]
RTOL = 1e-4
TIMEOUT = 900


def _command(command: list[str], out: Path, env: dict[str, str], flows: list[str]) -> Command:
    # The working directory is on a ``python -m`` process's path: no directory in it may be named
    # like a package (an output directory "zkit" or "deepspeed" would shadow the real one).
    return Command(command + [str(HERE / "hf_flows.py"), "--out", str(out), *flows], env=env, cwd=str(out.parent),
                   timeout=TIMEOUT)


def _results(done: list, root: Path, side: str) -> dict:
    """The flows' results and the launched flow's, from the two runs ``done`` (``root/out-<side>``
    and ``root/out-<side>-launch``)."""
    for proc in done:
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            raise AssertionError(f"{' '.join(proc.args[:4])} ... failed with exit code {proc.returncode}:\n{tail}")
    results = json.loads((root / f"out-{side}" / "results.json").read_text())
    launched = json.loads((root / f"out-{side}-launch" / "results.json").read_text())
    return {**results, LAUNCHED: launched[LAUNCHED]}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore", **extra)
    return env


def _zkit_side(root: Path) -> list[Command]:
    return [_command([sys.executable, "-m", "zkit.cli", "run", "--nproc", "2"], root / "out-zkit", _env(), FLOWS),
            _command([sys.executable, "-m", "accelerate.commands.launch", *LAUNCH_FLAGS], root / "out-zkit-launch",
                     _env(), [LAUNCHED])]


def _peer_side(root: Path) -> list[Command]:
    """The two runs (where the first fails, ``peer_env`` tells whether the environment is why)."""
    if not PEER_PYTHON.exists():
        return []
    env = _env(DS_ACCELERATOR="cpu")
    return [_command([str(PEER_PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2"], root / "out-deepspeed",
                     env, FLOWS),
            _command([str(PEER_PYTHON), "-m", "accelerate.commands.launch", *LAUNCH_FLAGS],
                     root / "out-deepspeed-launch", env, [LAUNCHED])]


#: run beside the other tests from the session's start (tests/background.py)
BACKGROUND = {"zkit_results": _zkit_side, "peer_results": _peer_side}


@pytest.fixture(scope="module")
def zkit_results(background, request) -> dict:
    root, done = background.wait(request)
    return _results(done, root, "zkit")


@pytest.fixture(scope="module")
def peer_results(background, request) -> dict:
    root, done = peer_env.wait_for_peer_runs(background, request, "deepspeed", "transformers", "accelerate")
    return _results(done, root, "deepspeed")


def test_the_peer_side_runs_the_flows_and_no_probe(tmp_path):
    commands = _peer_side(tmp_path)
    assert len(commands) == (2 if PEER_PYTHON.exists() else 0)
    assert all(str(HERE / "hf_flows.py") in c.argv for c in commands)


def test_dropin_ran(zkit_results):
    assert zkit_results["deepspeed"]["version"].endswith("+zkit")


@pytest.mark.parametrize("flow", [f for f in FLOWS if f.startswith("trainer")])
def test_trainer_resume_and_save(zkit_results, flow):
    run = zkit_results[flow]
    assert len(run["losses"]) == 4 and all(math.isfinite(x) for x in run["losses"])
    # resuming from checkpoint-2 replays steps 3 and 4 exactly
    assert run["resumed"] == run["losses"][2:]
    # the learning rate after each step: DeepSpeed's WarmupDecayLR (log warm-up over 2 steps from
    # 0, linear decay to step 4) or the Trainer's own linear schedule
    expected = [0.0, 1e-3, 2e-3, 1e-3] if flow.startswith("trainer_own") else [0.0, 2e-3, 2e-3, 1e-3]
    assert run["lr"] == pytest.approx(expected)
    assert all(math.isfinite(s) and q > 0 for s, q in run["saved"].values())


@pytest.mark.parametrize("flow", FLOWS + [LAUNCHED])
def test_losses_equal_real_deepspeed(zkit_results, peer_results, flow):
    ours, theirs = zkit_results[flow], peer_results[flow]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)
    for key in ("lr", "resumed"):
        if key in theirs:
            assert ours[key] == pytest.approx(theirs[key], rel=RTOL), key
    # DeepSpeed reports no gradient norm at stage 0 (None); zkit reports it at every stage
    for mine, real in zip(ours.get("grad_norm", []), theirs.get("grad_norm", [])):
        assert real is None or mine == pytest.approx(real, rel=RTOL)
    # what save_model / get_state_dict wrote: the same tensors with the same values. The sum of
    # squares is the sharp test (weight decay on a norm's weight moves it by ~1e-4 in 4 steps); the
    # abs terms cover biases that stay near zero (BERT's key bias gets no gradient at all). A sum of
    # thousands of values near zero carries rounding of a few 1e-6 from the order of the additions
    # (GPT-2's fused qkv bias under Accelerate: 1.4e-6 of 2.5e-3), so its abs term is 5e-6.
    assert sorted(ours["saved"]) == sorted(theirs["saved"])
    for name, (total, squares) in theirs["saved"].items():
        assert ours["saved"][name][0] == pytest.approx(total, rel=1e-4, abs=5e-6), name
        assert ours["saved"][name][1] == pytest.approx(squares, rel=1e-5, abs=1e-9), name
