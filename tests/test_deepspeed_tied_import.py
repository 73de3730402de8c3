"""A DeepSpeed ZeRO-2 or ZeRO-3 run of a model whose head is tied to its token embedding (GPT-2's
tying) continues in zkit as DeepSpeed's own run continues: the real DeepSpeed (``.venv-peers``)
trains :class:`TiedLM` on 2 ranks, saves and trains on; zkit loads the checkpoint at the same
stage on 2 ranks and at the other stage on 1, and every loss after the load equals DeepSpeed's
uninterrupted continuation within 1e-6 relative (fp32). The first loss after a load only checks
the weights; the ones after it check the optimizer state of the tied weight."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zkit
from zkit.testing import run_ranks

from deepspeed_peer_model import ds_config
from deepspeed_peer_tied import TiedLM, tied_batch
from test_deepspeed_checkpoint_import import BEFORE, peer_commands, peer_job

AFTER = 4
RTOL = 1e-6


#: started with the session, beside the other tests (tests/background.py)
BACKGROUND = {"tied_run": peer_commands("deepspeed_peer_tied.py", "--runs", "2:fp32,3:fp32", "--after", str(AFTER))}


@pytest.fixture(scope="module")
def tied_run(background, request) -> tuple[Path, dict]:
    root = peer_job(background, request)
    return root, json.loads((root / "tied-results.json").read_text())


def continue_tied(runs: list[tuple[str, int]]) -> list[list[float]]:
    """Rank function: load each ``(deepspeed_dir, zkit_stage)`` into a fresh engine, train on."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out = []
    for path, stage in runs:
        model = TiedLM()
        assert model.head.weight is model.wte.weight
        with torch.no_grad():  # the checkpoint must overwrite every value
            for p in model.parameters():
                p.fill_(0.5)
        engine, *_ = zkit.initialize(model=model, config=ds_config(stage, world))
        engine.load_checkpoint(path)
        losses = []
        for k in range(BEFORE, BEFORE + AFTER):
            loss = engine(*tied_batch(k, rank, world))
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        engine.close()
        out.append(losses)
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_tied_embeddings_continue_as_deepspeeds_run(tied_run, world):
    root, reference = tied_run
    # 2 ranks: the stage DeepSpeed saved at; 1 rank: the other one
    runs = [(str(root / f"tied-{s}-fp32"), s if world == 2 else 5 - s) for s in (2, 3)]
    results = run_ranks(continue_tied, world, args=(runs,), timeout=300)[0]
    for (path, stage), got in zip(runs, results):
        want = reference[Path(path).name]["after"]
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= RTOL * abs(w), (
                f"DeepSpeed {Path(path).name} -> zkit stage {stage} on {world} rank(s): step {BEFORE + k} loss "
                f"{g!r}, DeepSpeed's {w!r}\n{got}\n{want}")


def test_a_nan_master_weight_in_a_deepspeed_checkpoint_is_refused_naming_the_file(tied_run, tmp_path):
    """DeepSpeed saves a diverged run's weights as they are; zkit refuses to continue from them."""
    import shutil
    import subprocess

    from peer_env import PEER_PYTHON, environment

    root, _ = tied_run
    shutil.copytree(root / "tied-2-fp32", tmp_path / "ckpt")
    optim = tmp_path / "ckpt" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    poison = ("import sys, torch; f = sys.argv[1]; d = torch.load(f, weights_only=False); "
              "d['optimizer_state_dict']['single_partition_of_fp32_groups'][0].data[3] = float('nan'); torch.save(d, f)")
    subprocess.run([str(PEER_PYTHON), "-c", poison, str(optim)], env=environment(), check=True, timeout=300)
    results = run_ranks(load_error, 1, args=(str(tmp_path / "ckpt"),), timeout=300)
    assert results[0].startswith(f"{optim}: the fp32 master weights of "), results[0]
    assert results[0].endswith("hold 1 NaN or infinite value(s); the run diverged before this save: load an "
                               "earlier checkpoint"), results[0]


def load_error(path: str) -> str | None:
    """Rank function: the error loading ``path`` into a fresh engine gives, if any."""
    engine, *_ = zkit.initialize(model=TiedLM(), config=ds_config(2, torch.distributed.get_world_size()))
    try:
        engine.load_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - the test checks which error and its text
        return f"{exc}"
    finally:
        engine.close()
    return None
