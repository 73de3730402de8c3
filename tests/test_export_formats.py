"""Checkpoints out to what others read: a Hugging Face save_pretrained directory that
from_pretrained loads with equal outputs, and PyTorch Distributed Checkpoint (DCP) both ways."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import export_ranks
from zkit.core.checkpoint_errors import CheckpointError
from zkit.testing import run_ranks


@pytest.mark.parametrize("stage", [0, 3])
def test_hf_export_loads_with_from_pretrained_and_equal_outputs(tmp_path, stage):
    transformers = pytest.importorskip("transformers")
    ckpt, config_dir, out = tmp_path / "ckpt", tmp_path / "config", tmp_path / "export"
    (trained,) = run_ranks(export_ranks.train_gpt2_and_save, 2, args=(str(ckpt), str(config_dir), stage))[:1]
    from zkit.checkpoint.export_hf import write_hf_pretrained

    # a tiny shard limit makes the export sharded, with an index, as large models are
    done = write_hf_pretrained(ckpt, out, config=config_dir, max_shard_bytes=40_000)
    assert len(done.shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert done.tied == ("lm_head.weight",)  # written once, re-tied by the model
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(done.shards)
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=export_ranks._batch(99, 0)).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)


def test_hf_export_through_the_cli_and_its_errors(tmp_path):
    pytest.importorskip("transformers")
    ckpt, config_dir = tmp_path / "ckpt", tmp_path / "config"
    run_ranks(export_ranks.train_gpt2_and_save, 1, args=(str(ckpt), str(config_dir), 2))
    cli = [sys.executable, "-m", "zkit.cli", "consolidate", str(ckpt)]
    ok = subprocess.run([*cli, str(tmp_path / "hf"), "--format", "hf", "--hf-config", str(config_dir / "config.json"),
                         "--dtype", "bf16"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "1 safetensors shard(s)" in ok.stdout and "lm_head.weight" in ok.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    missing = subprocess.run([*cli, str(tmp_path / "hf2"), "--format", "hf"], capture_output=True, text=True)
    assert missing.returncode != 0 and "needs --hf-config" in missing.stderr
    again = subprocess.run([*cli, str(tmp_path / "hf"), "--format", "hf", "--hf-config", str(config_dir)],
                           capture_output=True, text=True)
    assert again.returncode != 0 and "exists and is not empty" in again.stderr


@pytest.mark.parametrize("stages", [(2, 2), (1, 3)])
def test_dcp_round_trip_continues_training(tmp_path, stages):
    """zkit (2 ranks) -> DCP -> zkit at another world size and stage: the same continuation as
    from the zkit checkpoint itself."""
    from zkit.checkpoint.dcp import write_dcp

    saved_stage, load_stage = stages
    ckpt, dcp_dir = tmp_path / "ckpt", tmp_path / "dcp"
    ranks = run_ranks(export_ranks.save_small, 2, args=(str(ckpt), saved_stage))
    straight = [(a + b) / 2 for a, b in zip(ranks[0]["after"], ranks[1]["after"])]  # the global batch's loss
    done = write_dcp(ckpt, dcp_dir)
    assert done.tensors == 4 and done.optimizer_tensors == 4 and (dcp_dir / ".metadata").is_file()
    from_zkit = run_ranks(export_ranks.resume_small, 1, args=(str(ckpt), load_stage, "t"))[0]["after"]
    from_dcp = run_ranks(export_ranks.resume_small, 1, args=(str(dcp_dir), load_stage, None))[0]["after"]
    assert from_dcp == pytest.approx(from_zkit, rel=1e-6)
    assert from_dcp == pytest.approx(straight, rel=1e-5)


def test_dcp_export_reads_with_torchs_own_api(tmp_path):
    """What an FSDP2/torchtitan job does with the directory: dcp.load into its state dict."""
    import torch.distributed.checkpoint as dcp

    from zkit.checkpoint.dcp import write_dcp

    ckpt = tmp_path / "ckpt"
    run_ranks(export_ranks.save_small, 2, args=(str(ckpt), 3))
    write_dcp(ckpt, tmp_path / "dcp")
    from zkit.checkpoint.consolidate import consolidate

    reference = torch.load(consolidate(ckpt, tmp_path / "full.pt"), weights_only=True)
    model = export_ranks._Net()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, value in state["model"].items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


def test_dcp_without_optimizer_state_needs_weights_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = export_ranks._Net()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "w"), no_dist=True)
    with pytest.raises(Exception, match="holds no optimizer state.*load_optimizer_states=False"):
        run_ranks(export_ranks.resume_small, 1, args=(str(tmp_path / "w"), 2, None))
    run_ranks(export_ranks.load_weights_only, 1, args=(str(tmp_path / "w"),))


def test_export_refuses_a_non_empty_directory(tmp_path):
    from zkit.checkpoint.dcp import write_dcp

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        write_dcp(tmp_path, tmp_path / "out")
