"""The Transformers ``Trainer`` with ``parallelism_config`` (Accelerate's
``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``), unmodified, on the drop-in: its losses
and gradient norms equal real DeepSpeed 0.19.8's on the same run (``.venv-peers``) at 2 ranks
(ZeRO-2, AdamW and SGD) and 4 ranks (ZeRO-3, grouped-query heads repeated to one per rank), and its
losses equal the same run's without sequence parallelism at the same global batch (one rank).
``hf_sequence_flow.py`` is the run; without the peer environment the zkit side still runs and is
checked against the run without sequence parallelism."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from background import Command
import peer_env
from peer_env import PEER_PYTHON

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("zkit_sequence")

HERE = Path(__file__).resolve().parent
#: name -> (ranks, sequence-parallel ranks, ZeRO stage, optimizer)
FLOWS = {"sp2-zero2": (2, 2, 2, "adamw"), "sp4-zero3": (4, 4, 3, "adamw"), "sp2-zero2-sgd": (2, 2, 2, "sgd")}
#: the same runs without sequence parallelism, at the same global batch (one replica: one rank)
REFERENCE = {"none-zero2": (1, 1, 2, "adamw")}
RTOL = 1e-5
TIMEOUT = 600


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               **extra)
    return env


def _flow(launcher: list[str], name: str, flow: tuple, root: Path, env: dict[str, str]) -> Command:
    ranks, sp, stage, optim = flow
    # the working directory is on the path of the launched script: no folder there is named like a package
    return Command([*launcher, str(ranks), str(HERE / "hf_sequence_flow.py"), "--out", str(root / name),
                    "--sp", str(sp), "--stage", str(stage), "--optim", optim], env=env, cwd=str(root), timeout=TIMEOUT)


def _zkit_side(root: Path) -> list[Command]:
    launcher = [sys.executable, "-m", "zkit.cli", "run", "--nproc"]
    return [_flow(launcher, name, flow, root, _env()) for name, flow in {**FLOWS, **REFERENCE}.items()]


def _peer_side(root: Path) -> list[Command]:
    if not PEER_PYTHON.exists():
        return []
    launcher = [str(PEER_PYTHON), "-m", "torch.distributed.run", "--nproc_per_node"]
    return [_flow(launcher, name, flow, root, _env(DS_ACCELERATOR="cpu")) for name, flow in FLOWS.items()]


BACKGROUND = {"zkit_runs": _zkit_side, "peer_runs": _peer_side}


def _results(root: Path, done: list, names) -> dict:
    for proc in done:
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            raise AssertionError(f"{' '.join(proc.args[:6])} ... failed with exit code {proc.returncode}:\n{tail}")
    return {name: json.loads((root / name / "results.json").read_text()) for name in names}


@pytest.fixture(scope="module")
def zkit_runs(background, request) -> dict:
    root, done = background.wait(request)
    return _results(root, done, {**FLOWS, **REFERENCE})


@pytest.fixture(scope="module")
def peer_runs(background, request) -> dict:
    root, done = peer_env.wait_for_peer_runs(background, request, "deepspeed", "transformers", "accelerate")
    return _results(root, done, FLOWS)


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_losses_and_gradient_norms_equal_real_deepspeed(zkit_runs, peer_runs, name):
    ours, theirs = zkit_runs[name], peer_runs[name]
    assert ours["deepspeed"].endswith("+zkit") and not theirs["deepspeed"].endswith("+zkit")
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL)
    for key in ("dp_world_size", "seq_dp_world_size", "sequence_parallel_size"):
        assert ours[key] == theirs[key], key


@pytest.mark.parametrize("name", ["sp2-zero2", "sp4-zero3"])
def test_losses_equal_the_run_without_sequence_parallelism(zkit_runs, name):
    ranks, sp, stage, _ = FLOWS[name]
    run, reference = zkit_runs[name], zkit_runs["none-zero2"]
    assert len(run["losses"]) == 4
    assert run["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    # DeepSpeed's gradient scale under its sequence groups: P times the loss's at stages 0-2, the
    # loss's at stage 3 (zkit_deepspeed.sequence_mpu)
    scale = sp if stage < 3 else 1
    assert run["grad_norm"] == pytest.approx([scale * n for n in reference["grad_norm"]], rel=RTOL)
    # DeepSpeed answers None for the data-parallel size under its sequence groups; ZeRO shards over every rank
    assert run["dp_world_size"] is None and run["seq_dp_world_size"] == ranks and run["sequence_parallel_size"] == sp
    assert reference["dp_world_size"] == 1 and reference["sequence_parallel_size"] == 1

