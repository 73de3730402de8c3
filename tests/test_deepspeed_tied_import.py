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
from zkit.core.checkpoint_errors import CheckpointError
from zkit.testing import run_ranks

from deepspeed_peer_model import ds_config
from deepspeed_peer_tied import TiedGPT, TiedLM, gpt_batches, gpt_config, tied_batch
from test_deepspeed_checkpoint_import import BEFORE, peer_commands, peer_job

AFTER = 4
RTOL = 1e-6
#: DeepSpeed's FusedAdam and its clipping factor against torch's AdamW and zkit's: 1e-6 relative at
#: the third step after the load (a wrong clipping is 1e-2 at the first)
GPT_RTOL = 1e-5


#: started with the session, beside the other tests (tests/background.py)
BACKGROUND = {"tied_run": peer_commands("deepspeed_peer_tied.py", "--runs", "2:fp32,3:fp32", "--after", str(AFTER)),
              "tied_gpt_run": peer_commands("deepspeed_peer_tied.py", "--runs", "2:gpt,3:gpt")}


@pytest.fixture(scope="module")
def tied_run(background, request) -> tuple[Path, dict]:
    root = peer_job(background, request)
    return root, json.loads((root / "tied-results.json").read_text())


@pytest.fixture(scope="module")
def tied_gpt_run(background, request) -> tuple[Path, dict]:
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
        out.append(train_on(engine, lambda k: [tied_batch(k, rank, world)], range(BEFORE, BEFORE + AFTER)))
        engine.close()
    return out


def train_on(engine, micro_batches, steps) -> list[float]:
    """Each step's loss (the mean over its ``micro_batches(step)`` and the ranks)."""
    losses = []
    for k in steps:
        mean = torch.zeros(())
        batches = micro_batches(k)
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            mean += loss.detach().float() / len(batches)
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    return losses


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


def continue_gpt(runs: list[tuple[str, int]], clipping: float | None,
                 dropin: bool = False) -> list[list[float] | str]:
    """Rank function: load each ``(deepspeed_dir, zkit_stage)`` into a fresh :class:`TiedGPT`
    engine with DeepSpeed's config (plus ``gradient_clipping`` unless ``None``) and train on; the
    losses, or the load's error. ``dropin``: the engine comes from the drop-in's
    ``deepspeed.initialize`` instead of ``zkit.initialize``."""
    import deepspeed

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out: list[list[float] | str] = []
    initialize = deepspeed.initialize if dropin else zkit.initialize
    for path, stage in runs:
        config = gpt_config(stage, world) | ({} if clipping is None else {"gradient_clipping": clipping})
        engine, *_ = initialize(model=TiedGPT(), config=config)
        try:
            engine.load_checkpoint(path)
        except CheckpointError as exc:
            out.append(f"{exc}")
            engine.close()
            continue
        out.append(train_on(engine, lambda k: gpt_batches(k, rank, world), range(BEFORE, BEFORE + 3)))
        engine.close()
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_a_tied_gpt_continues_as_deepspeeds_resume_with_deepspeeds_clipping(tied_gpt_run, world):
    root, reference = tied_gpt_run
    runs = [(str(root / f"tied-gpt-{s}"), s if world == 2 else 5 - s) for s in (2, 3)]
    results = run_ranks(continue_gpt, world, args=(runs, 1.0), timeout=600)[0]
    for (path, stage), got in zip(runs, results):
        want = reference[Path(path).name]["after"][:3]
        assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) <= GPT_RTOL, (
            f"DeepSpeed {Path(path).name} -> zkit stage {stage} on {world} rank(s):\n{got}\n{want}")


def test_a_tied_gpt_whose_config_leaves_clipping_to_deepspeeds_default_is_refused_on_every_rank(tied_gpt_run):
    root, _ = tied_gpt_run
    where = root / "tied-gpt-2" / "global_step3"
    errors = run_ranks(continue_gpt, 2, args=([(str(root / "tied-gpt-2"), 2)], None), timeout=600)
    assert [e[0] for e in errors] == [errors[0][0]] * 2  # the same verdict on both ranks
    assert errors[0][0] == (
        f"{where}: the DeepSpeed run clipped the gradient norm at 1.0 (DeepSpeed 0.19.8's default: its config does "
        "not set gradient_clipping); this engine does not clip (zkit's default gradient_clipping is 0), so the run "
        "would not continue as DeepSpeed's own resume does. Set \"gradient_clipping\": 1.0 in the config to continue "
        "as DeepSpeed would, or set \"gradient_clipping\" to the value you choose")


def test_on_the_dropin_a_config_that_leaves_clipping_unset_continues_as_deepspeeds_resume(tied_gpt_run):
    """``deepspeed.initialize`` takes DeepSpeed's default ``gradient_clipping`` (1.0) when the
    config leaves it unset, so DeepSpeed's own config continues DeepSpeed's run unchanged."""
    root, reference = tied_gpt_run
    (got,) = run_ranks(continue_gpt, 2, args=([(str(root / "tied-gpt-2"), 2)], None, True), timeout=600)[0]
    want = reference["tied-gpt-2"]["after"][:3]
    assert not isinstance(got, str), got
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) <= GPT_RTOL, f"{got}\n{want}"


def test_a_config_that_sets_gradient_clipping_continues_a_deepspeed_run_with_its_own(tied_gpt_run):
    """A chosen value is honoured, as DeepSpeed's own resume reads it from the config: 0 continues
    unclipped (and so differs from DeepSpeed's continuation after the first loss)."""
    root, reference = tied_gpt_run
    (got,) = run_ranks(continue_gpt, 1, args=([(str(root / "tied-gpt-2"), 2)], 0.0), timeout=600)[0]
    want = reference["tied-gpt-2"]["after"][:3]
    assert abs(got[0] - want[0]) <= GPT_RTOL * want[0]  # the weights loaded
    assert abs(got[1] - want[1]) > 1e-3 * want[1]  # unclipped: DeepSpeed's clipped step is not taken
