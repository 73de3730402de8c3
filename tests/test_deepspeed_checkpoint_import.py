"""A DeepSpeed run continues in zkit from DeepSpeed's own checkpoint.

The real DeepSpeed (``.venv-peers``, built by ``make peers``) trains :class:`PeerNet` on 2 ranks at
ZeRO stages 1, 2 and 3, saves, and continues for a few steps: the reference. zkit loads each saved
directory at the same world size and stage, at world size 1 and at another stage, continues on the
same batches, and its losses must equal DeepSpeed's within 1e-4 relative (fp32; bf16 and fp16 within
their rounding). DeepSpeed's pipeline checkpoints continue in zkit at other stage counts. The checkpoints
are generated once per session in a temporary directory; nothing binary is committed.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from background import Command

import zkit
from zkit.testing import run_ranks

import peer_env
from deepspeed_peer_model import PeerNet, batch, ds_config
from peer_env import PEER_PYTHON

HERE = Path(__file__).resolve().parent
BEFORE, AFTER = 3, 3
RTOL = 1e-4
STAGES = (1, 2, 3)
#: DeepSpeed's CPU offload (its own CPU Adam), bf16, and fp16 with its dynamic loss scale
OTHER_RUNS = ("2:fp32:offload", "3:bf16", "2:fp16")
#: bf16 continues within bf16's rounding (8 bits of mantissa), not bit for bit
BF16_RTOL = 2e-2
#: fp16 (11 bits)
FP16_RTOL = 5e-3


def _peer_command(script: str, root: Path, *args: str) -> Command:
    """A DeepSpeed peer script in DeepSpeed's interpreter, writing into ``root``."""
    return Command([str(PEER_PYTHON), str(HERE / script), "--out", str(root), "--before", str(BEFORE), "--after",
                    str(AFTER), *args], env=peer_env.environment(), timeout=600)


def _peer_ran(what: str, proc) -> None:
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"DeepSpeed's side ({what}) failed with exit code {proc.returncode}:\n{tail}")


def peer_commands(script: str, *args: str, then=lambda root: []):
    """A ``BACKGROUND`` entry (tests/background.py) for a fixture that runs a DeepSpeed peer script:
    the script, then the commands ``then(root)``."""
    def make(root: Path) -> list[Command]:
        if not PEER_PYTHON.exists():
            return []
        return [_peer_command(script, root, *args), *then(root)]
    return make


def peer_job(background, request) -> Path:
    """Wait for the fixture's peer commands (skipped without the peer environment, or when it cannot
    import DeepSpeed); the directory they wrote into."""
    if not PEER_PYTHON.exists():
        pytest.skip(f"no DeepSpeed peer environment at {PEER_PYTHON} (build it with `make peers`)")
    root, done = background.wait(request)
    if any(proc.returncode != 0 for proc in done) and (error := peer_env.cannot_import("deepspeed")):
        pytest.skip(f"{PEER_PYTHON} cannot import deepspeed: {[error]}")
    for proc in done:
        _peer_ran(Path(proc.args[1]).name, proc)
    return root


def _conversions(root: Path) -> list[Command]:
    """DeepSpeed's own ``zero_to_fp32`` conversions of the runs ``test_zero_to_fp32`` compares."""
    from test_zero_to_fp32 import deepspeeds_conversion_argv

    return [Command(deepspeeds_conversion_argv(root), env=peer_env.environment(), timeout=600)]


PEER_RUNS = ",".join([f"{s}:fp32" for s in STAGES] + list(OTHER_RUNS))


@pytest.fixture(scope="module")
def deepspeed_run(background, request) -> tuple[Path, dict]:
    """DeepSpeed's checkpoints (``<root>/<stage>-fp32/``), its losses before and after the save, and
    its ``zero_to_fp32`` conversions of two of them (``<root>/<run>.converted/``)."""
    root = peer_job(background, request)
    return root, json.loads((root / "results.json").read_text())


def continue_runs(runs: list[tuple[str, int, str]]) -> list[dict]:
    """Rank function: for every ``(deepspeed_dir, zkit_stage, dtype)`` load the DeepSpeed checkpoint
    into a fresh engine and train ``AFTER`` more steps; the global-batch losses and what was restored."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out = []
    for path, stage, dtype in runs:
        model = PeerNet()
        with torch.no_grad():  # the loaded checkpoint must overwrite every value
            for p in model.parameters():
                p.fill_(0.5)
        engine, *_ = zkit.initialize(model=model, config=ds_config(stage, world, dtype))
        loaded, client = engine.load_checkpoint(path)
        restored = {"steps": engine.global_steps, "samples": engine.global_samples, "lr": engine.get_lr()[0],
                    "loss_scale": engine.loss_scaler.state_dict()["scale"],
                    "epoch": client.get("epoch"), "note": client.get("note"), "loaded": loaded}
        losses = []
        for k in range(BEFORE, BEFORE + AFTER):
            x, y = batch(k, rank, world)
            loss = engine(x.to(engine.dtype), y.to(engine.dtype))
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        engine.close()
        out.append({"losses": losses, **restored})
    return out


def _expect_same(got: list[float], want: list[float], what: str, rtol: float = RTOL) -> None:
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"{what}: step {BEFORE + k} loss {g!r}, DeepSpeed's {w!r}\n{got}\n{want}"


@pytest.mark.parametrize("world", [2, 1])
def test_zkit_continues_deepspeed_runs(deepspeed_run, world):
    """Every ZeRO stage's checkpoint, at the same stage and at the next one, on 2 ranks and on 1."""
    root, reference = deepspeed_run
    runs = [(str(root / f"{s}-fp32"), z, "fp32") for s in STAGES for z in (s, s % 3 + 1)]
    results = run_ranks(continue_runs, world, args=(runs,), timeout=300)[0]
    for (path, stage, _), got in zip(runs, results):
        name = Path(path).name
        what = f"DeepSpeed {name} -> zkit stage {stage} on {world} rank(s)"
        _expect_same(got["losses"], reference[name]["after"], what)
        assert (got["steps"], got["samples"]) == (BEFORE, BEFORE * 8), what
        assert (got["epoch"], got["note"]) == (3, "peer"), what
        assert got["loaded"].endswith(f"global_step{BEFORE}"), what



def test_zkit_continues_offloaded_bf16_and_fp16_deepspeed_runs(deepspeed_run):
    """DeepSpeed's CPU-offload checkpoint (its CPU Adam keeps an integer step) into stages 2 and 1;
    its bf16 stage-3 checkpoint into zkit bf16 at stage 3 and fp32 at stage 2; its fp16 stage-2
    checkpoint into zkit fp16 at stage 2 (the dynamic loss scale carried over) and fp32 at stage 3."""
    root, reference = deepspeed_run
    runs = [(str(root / "2-fp32-offload"), 2, "fp32"), (str(root / "2-fp32-offload"), 1, "fp32"),
            (str(root / "3-bf16"), 3, "bf16"), (str(root / "3-bf16"), 2, "fp32"),
            (str(root / "2-fp16"), 2, "fp16"), (str(root / "2-fp16"), 3, "fp32")]
    results = run_ranks(continue_runs, 2, args=(runs,), timeout=300)[0]
    for (path, stage, dtype), got in zip(runs, results):
        name = Path(path).name
        rtol = BF16_RTOL if "bf16" in name else FP16_RTOL if "fp16" in name else RTOL
        _expect_same(got["losses"], reference[name]["after"], f"DeepSpeed {name} -> zkit stage {stage} {dtype}", rtol)
        assert got["steps"] == BEFORE
        if dtype == "fp16":  # DeepSpeed's dynamic loss scale at the save
            assert got["loss_scale"] == reference[name]["loss_scale"], got



@pytest.mark.parametrize("run", [f"{s}-fp32" for s in STAGES] + ["2-fp32-offload", "3-bf16", "2-fp16"])
def test_consolidate_equals_deepspeeds_zero_to_fp32(deepspeed_run, run, tmp_path, capsys):
    """``zkit consolidate`` on a DeepSpeed directory writes what DeepSpeed's ``zero_to_fp32``
    consolidates, bit for bit (safetensors and .pt), every buffer included."""
    import safetensors.torch

    from zkit.cli import main as cli_main

    root, _ = deepspeed_run
    want = torch.load(root / f"{run}.zero_to_fp32.pt", weights_only=True)
    assert cli_main(["consolidate", str(root / run), str(tmp_path / "model.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out
    got = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert list(got) == list(PeerNet().state_dict())
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.float()), name
    assert cli_main(["consolidate", str(root / run / "global_step3"), str(tmp_path / "model.pt"), "--dtype", "bf16"]) == 0
    half = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(half[n], want[n].to(torch.bfloat16)) for n in want)



def test_zero_to_fp32_functions_equal_deepspeeds(deepspeed_run, tmp_path):
    """``deepspeed.utils.zero_to_fp32`` on zkit writes what DeepSpeed's writes from the same
    checkpoints: state dict, files, shards, index (checks in ``test_zero_to_fp32.py``)."""
    from test_zero_to_fp32 import RUNS, check_against_deepspeed

    root, _ = deepspeed_run  # DeepSpeed's conversions ran after its training run
    for run in RUNS:
        check_against_deepspeed(root, run, tmp_path / run)

# -- bad input: without DeepSpeed ----------------------------------------------------------------------

class _RunsCode:
    """A pickle that would run a shell command when unpickled without restrictions."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fake_deepspeed_dir(root: Path, model_state: dict) -> Path:
    where = root / "global_step1"
    where.mkdir(parents=True)
    torch.save(model_state, where / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step1")
    return where


def test_a_pickle_outside_the_allow_list_is_refused_naming_file_and_object(tmp_path):
    from zkit.checkpoint import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint

    marker = tmp_path / "ran"
    where = _fake_deepspeed_dir(tmp_path / "ckpt", {"module": {"w": torch.ones(2)}, "extra": _RunsCode(marker)})
    with pytest.raises(CheckpointError) as err:
        DeepSpeedCheckpoint(where)
    assert str(where / "mp_rank_00_model_states.pt") in str(err.value)
    assert "refusing to unpickle posix.system" in str(err.value)
    assert not marker.exists()


def test_deepspeed_stand_ins_load_without_deepspeed(tmp_path, monkeypatch):
    """What DeepSpeed pickles (its loss scaler, its stage enum, argparse.Namespace) loads as inert
    stand-ins, with their attributes."""
    import argparse
    import types

    from zkit_deepspeed.checkpoint.unpickler import load_file

    # A file as DeepSpeed writes it, made without DeepSpeed: classes in modules named like its own.
    scaler_cls = type("DynamicLossScaler", (), {"__module__": "deepspeed.runtime.fp16.loss_scaler"})
    enum_cls = type("ZeroStageEnum", (int,), {"__module__": "deepspeed.runtime.zero.config"})
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler",
                 "deepspeed.runtime.zero", "deepspeed.runtime.zero.config"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["deepspeed.runtime.fp16.loss_scaler"].DynamicLossScaler = scaler_cls
    sys.modules["deepspeed.runtime.zero.config"].ZeroStageEnum = enum_cls
    scaler = scaler_cls()
    scaler.cur_scale, scaler.cur_iter = 256.0, 7
    path = tmp_path / "optim.pt"
    torch.save({"loss_scaler": scaler, "zero_stage": enum_cls(2), "args": argparse.Namespace(lr=0.1),
                "t": torch.arange(3)}, path)
    data = load_file(path)
    assert data["loss_scaler"].origin == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    assert (data["loss_scaler"].cur_scale, data["loss_scaler"].cur_iter) == (256.0, 7)
    assert data["zero_stage"] == 2 and data["args"].lr == 0.1
    assert data["t"].tolist() == [0, 1, 2]


def test_an_incomplete_deepspeed_checkpoint_names_the_missing_file(tmp_path):
    from zkit.checkpoint import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint

    where = _fake_deepspeed_dir(tmp_path / "ckpt", {"module": {}, "param_shapes": [{}]})
    torch.save({}, where / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt is missing"):
        DeepSpeedCheckpoint(where)


def test_a_tensor_parallel_deepspeed_checkpoint_is_refused(tmp_path):
    from zkit.checkpoint import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint

    where = _fake_deepspeed_dir(tmp_path / "ckpt", {"module": {}})
    torch.save({"module": {}}, where / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="2 tensor-parallel ranks .* not supported"):
        DeepSpeedCheckpoint(where)


def test_a_stage0_deepspeed_checkpoint_is_refused(tmp_path):
    from zkit.checkpoint import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint

    where = _fake_deepspeed_dir(tmp_path / "ckpt", {"module": {}, "optimizer": {}})
    with pytest.raises(CheckpointError, match="without ZeRO .stage 0.; only ZeRO stages 1-3"):
        DeepSpeedCheckpoint(where)


def test_a_refused_deepspeed_checkpoint_changes_no_rank_s_state(deepspeed_run, tmp_path):
    """A NaN in rank 1's fp32 master (a run that diverged, or damage): every rank refuses, naming
    the file, with one message and its state unchanged (the pieces of the files read before it were
    copied into the engine, and kept)."""
    import shutil
    import struct

    from checkpoint_fault_ranks import load_refused_deepspeed
    from zkit_deepspeed.checkpoint.unpickler import load_file

    root, _ = deepspeed_run
    shutil.copytree(root / "2-fp32", tmp_path / "ckpt")
    where = tmp_path / "ckpt" / f"global_step{BEFORE}"
    optim = where / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    master = load_file(optim)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    raw = bytearray(optim.read_bytes())
    at = raw.find(master[:16].detach().numpy().tobytes())
    assert at > 0
    raw[at : at + 4] = struct.pack("<f", float("nan"))
    optim.write_bytes(bytes(raw))
    results = run_ranks(load_refused_deepspeed, 2, args=(str(tmp_path / "ckpt"),), timeout=300)
    assert results[0] == results[1], results
    assert results[0]["unchanged"]
    message = results[0]["message"]
    assert f"{optim}: the fp32 master weights of " in message and "NaN" in message, message


# -- DeepSpeed PipelineModule checkpoints ----------------------------------------------------------------

#: DeepSpeed's pipeline runs: 2 stages x 2 data-parallel ranks, ZeRO-1 in fp32 and bf16
PIPE_RUNS = ("1:fp32", "1:bf16")


PIPE_ARGS = ("--runs", ",".join(PIPE_RUNS), "--world", "4", "--stages", "2")
#: started with the session, beside the other tests (tests/background.py)
BACKGROUND = {"deepspeed_run": peer_commands("deepspeed_peer_run.py", "--runs", PEER_RUNS, then=_conversions),
              "deepspeed_pipe_run": peer_commands("deepspeed_peer_pipe.py", *PIPE_ARGS)}


@pytest.fixture(scope="module")
def deepspeed_pipe_run(background, request) -> tuple[Path, dict]:
    """DeepSpeed's pipeline checkpoints (``<root>/pipe-<zero>-<dtype>/``) and its losses."""
    root = peer_job(background, request)
    return root, json.loads((root / "pipe-results.json").read_text())


def continue_pipe_runs(runs: list[tuple[str, int, int, str]]) -> list[dict]:
    """Rank function: for every ``(deepspeed_dir, pipeline_stages, zero_stage, dtype)`` load the
    DeepSpeed pipeline checkpoint into a fresh zkit ``PipelineModule`` and train ``AFTER`` more steps."""
    from deepspeed_peer_model import pipe_batches, pipe_config, pipe_layers, pipe_loss
    from deepspeed import pipe

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out = []
    for path, stages, zero, dtype in runs:
        module = pipe.PipelineModule(layers=pipe_layers(pipe), num_stages=stages, loss_fn=pipe_loss,
                                     partition_method="uniform")
        with torch.no_grad():  # the loaded checkpoint must overwrite every value
            for p in module.parameters():
                p.fill_(0.5)
        dp_rank, dp_world = module.grid.coord(rank).data, module.grid.degree("data")
        engine, *_ = zkit.initialize(model=module, config=pipe_config(zero, dp_world, dtype))
        loaded, client = engine.load_checkpoint(path)
        steps, losses = engine.global_steps, []
        for k in range(BEFORE, BEFORE + AFTER):
            micro = [(x.to(engine.dtype), y.to(engine.dtype)) for x, y in pipe_batches(k, dp_rank, dp_world)]
            losses.append(float(engine.train_batch(iter(micro))))
        engine.close()
        out.append({"losses": losses, "steps": steps, "epoch": client.get("epoch"), "loaded": loaded})
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_zkit_continues_deepspeed_pipeline_runs(deepspeed_pipe_run, world):
    """DeepSpeed's 2-stage x 2-replica pipeline checkpoints continue in zkit with the same losses:
    on 2 ranks as 2 stages (ZeRO-1) and as 1 stage with 2 replicas (ZeRO-2), and on 1 rank."""
    root, reference = deepspeed_pipe_run
    layouts = [(2, 1), (1, 2)] if world == 2 else [(1, 1)]
    runs = [(str(root / f"pipe-{run.replace(':', '-')}"), stages, zero, run.split(":")[1])
            for run in PIPE_RUNS for stages, zero in layouts]
    results = run_ranks(continue_pipe_runs, world, args=(runs,), timeout=300)
    for (path, stages, zero, dtype), got in zip(runs, results[0]):
        name = Path(path).name
        what = f"DeepSpeed {name} -> zkit {stages} stage(s), ZeRO {zero}, {world} rank(s)"
        _expect_same(got["losses"], reference[name]["after"], what, BF16_RTOL if dtype == "bf16" else RTOL)
        assert (got["steps"], got["epoch"]) == (BEFORE, 3), what
        assert got["loaded"].endswith(f"global_step{BEFORE}"), what


def test_consolidate_a_deepspeed_pipeline_checkpoint(deepspeed_pipe_run, tmp_path):
    """``zkit consolidate`` joins the stages by layer name: every weight equals the layer files'
    (fp32 training weights are the masters), the tied weight written once."""
    import safetensors.torch

    from zkit_deepspeed.checkpoint.unpickler import load_file
    from zkit.cli import main as cli_main

    root, _ = deepspeed_pipe_run
    where = root / "pipe-1-fp32" / f"global_step{BEFORE}"
    assert cli_main(["consolidate", str(root / "pipe-1-fp32"), str(tmp_path / "model.safetensors")]) == 0
    got = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert list(got) == ["tied_modules.mix.weight", "0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                         "4.bias", "7.weight", "7.bias"]
    for layer in (0, 2, 4, 7):
        for name, tensor in load_file(where / f"layer_{layer:02d}-model_states.pt").items():
            assert torch.equal(got[f"{layer}.{name}"], tensor), f"{layer}.{name}"
    assert torch.equal(got["tied_modules.mix.weight"], load_file(where / "layer_01-model_states.pt")["weight"])


def test_a_deepspeed_bf16_checkpoint_without_zero_is_refused(tmp_path):
    """DeepSpeed's BF16_Optimizer (bf16 at stage 0) records neither a stage nor the parameters' shapes."""
    from zkit.checkpoint import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint

    where = _fake_deepspeed_dir(tmp_path / "ckpt", {"module": {"w": torch.ones(4)}, "param_shapes": None})
    torch.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [torch.ones(4)], "partition_count": [1]}},
               where / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="bf16 optimizer without ZeRO .stage 0., whose files do not record"):
        DeepSpeedCheckpoint(where)


def test_an_unsplit_deepspeed_checkpoint_into_a_split_model_is_refused_saying_why(tmp_path):
    """A pipeline stage has layer names, yet an unsplit run's checkpoint cannot map onto them: the
    error says so instead of claiming the model has no layer names."""
    pytest.importorskip("zkit_deepspeed")
    from types import SimpleNamespace

    from zkit.core.checkpoint_errors import CheckpointError
    from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint
    from zkit_deepspeed.checkpoint.load import _as_held_here

    class Stage(torch.nn.Module):  # what a pipeline stage shows the loader: its part and layer names
        model_parallel_part = ("pp_rank_00", {"stages": 2})

        def layer_names(self):
            return {"0.weight": "0.weight"}

    engine = SimpleNamespace(module=Stage())
    with pytest.raises(CheckpointError) as err:
        _as_held_here(engine, object.__new__(DeepSpeedCheckpoint), tmp_path)
    assert "a DeepSpeed checkpoint of an unsplit model loads only into an unsplit model" in str(err.value)
    assert "pipeline or tensor-parallel" in str(err.value) and "no layer_names()" not in str(err.value)
