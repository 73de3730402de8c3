"""Checkpoints: atomic, safe to load, and reshardable across world sizes and stages at load."""
import json
from pathlib import Path

import pytest
import torch

import zkit
from zkit.checkpoint import CheckpointError
from zkit.testing import run_ranks

import engine_ranks as er


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("stage", (0, 2))
def test_resume_same_world_and_stage_is_bit_exact(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(er.checkpoint_then_continue, 2, args=(path, stage), timeout=300)
    resumed = run_ranks(er.resume, 2, args=(path, stage), timeout=300)
    for a, b in zip(uninterrupted, resumed):
        assert b["steps"] == 2 and b["client"] == {"epoch": 7}
        assert a["losses"] == b["losses"]
        assert _max_diff(a["params"], b["params"]) == 0
        assert a["lr"] == b["lr"]
    layout = sorted(p.name for p in (tmp_path / "ckpt" / "global_step2").iterdir())
    assert layout == ["meta.msgpack", "rank_00000.pt", "rank_00001.pt"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"


@pytest.mark.parametrize(
    "save_world,save_stage,load_world,load_stage",
    [(2, 2, 1, 0), (2, 1, 4, 2), (4, 2, 2, 1), (2, 3, 1, 0), (2, 0, 4, 3)],
)
def test_reshard_at_load_continues_the_same_training(tmp_path, save_world, save_stage, load_world, load_stage):
    """Saved at N ranks / stage k, loaded at M ranks / stage j: the same global batches give the
    same losses (up to float reduction order)."""
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(er.checkpoint_then_continue, save_world, args=(path, save_stage, "fp32", 4 // save_world), timeout=300)
    resumed = run_ranks(er.resume, load_world, args=(path, load_stage, "fp32", 4 // load_world), timeout=300)
    def global_losses(results):  # each rank saw its own slice: average over ranks
        return [sum(r["losses"][i] for r in results) / len(results) for i in range(2)]

    assert global_losses(resumed) == pytest.approx(global_losses(uninterrupted), rel=1e-5)
    assert _max_diff(resumed[0]["params"], uninterrupted[0]["params"]) < 1e-5


def _engine(stage=0):
    return zkit.initialize(model=er.make_model(), config=er.config(stage, "fp32", 1, 1))[0]


def test_truncated_shard_names_the_file(tmp_path):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    shard = tmp_path / "t" / "rank_00000.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: cannot read checkpoint shard"):
        _engine().load_checkpoint(str(tmp_path), tag="t")


def test_shape_mismatch_names_the_parameter(tmp_path):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    model = er.TiedNet(vocab=14)
    other = zkit.initialize(model=model, config=er.config(0, "fp32", 1, 1))[0]
    with pytest.raises(CheckpointError, match=r"parameter 'embed.weight' has shape \(14, 6\) in the model but \(13, 6\)"):
        other.load_checkpoint(str(tmp_path), tag="t")


def test_missing_checkpoint_and_latest(tmp_path, caplog):
    # DeepSpeed's behaviour: no 'latest' file is a warning and (None, None), not an error.
    with caplog.at_level("WARNING", logger="zkit"):
        assert _engine().load_checkpoint(str(tmp_path)) == (None, None)
    assert f"no 'latest' file in {tmp_path}: nothing loaded" in caplog.text
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint metadata"):
        _engine().load_checkpoint(str(tmp_path), tag="x")


def test_unsafe_client_state_is_refused_before_writing(tmp_path):
    engine = _engine()
    with pytest.raises(CheckpointError, match="client_state must hold only tensors"):
        engine.save_checkpoint(str(tmp_path), tag="t", client_state={"fn": object()})
    assert not (tmp_path / "t").exists()


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="t")
    before = (tmp_path / "t" / "rank_00000.pt").read_bytes()
    import zkit.checkpoint.save as save

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(save, "write_meta", boom)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(str(tmp_path), tag="t")
    assert (tmp_path / "t" / "rank_00000.pt").read_bytes() == before
    assert (tmp_path / "latest").read_text() == "t"
