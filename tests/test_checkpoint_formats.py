"""Checkpoint formats are records of a hook family (``zkit_register_checkpoint_formats``): a format
a plugin registers is what ``engine.load_checkpoint`` and ``consolidate`` use; names are unique;
a format without an operation, or a DeepSpeed checkpoint without the drop-in, is refused by name.
The engine reaches a format through the hook ``zkit_checkpoint_format``, which a plugin may answer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkpoint_format_ranks as cfr
import zkit
from zkit.checkpoint import CheckpointError, consolidate
from zkit.checkpoint.formats import for_load
from zkit.cli import main as cli_main
from zkit.core.plugin_manager import PluginError, get_plugin_manager
from zkit.core.records import CheckpointFormatRecord
from zkit.testing import run_ranks


def test_a_plugin_format_is_used_by_load_checkpoint(tmp_path):
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / cfr.MARKER).write_text("0.5")
    out = run_ranks(cfr.load_with_a_plugin_format, 1, args=(str(tmp_path / "acme"), str(tmp_path / "z")))[0]
    assert out["path"] == str(tmp_path / "acme") and out["client"] == {"from": "acme"}
    assert out["calls"] == [{"tag": None, "optim": False, "lr": False}]  # load_module_only reached the format
    assert all(bool((w == 0.5).all()) for w in out["weights"])
    assert out["zkit_client"] == {}


class _Pieces:
    """A plugin format's pieces: one 2x2 parameter in one file."""

    def __init__(self, where: Path) -> None:
        self.where, self.extras_file = where, "w.bin"
        self.meta = {"params": {"w": [2, 2]}, "index": {"w.bin": [("w", 0, 4)]}}

    def pieces(self, fname, with_state=False):
        return [{"name": "w", "start": 0, "end": 4, "master": torch.arange(4.0), "state": {}}]

    def extras(self):
        return {}

    def param_groups(self):
        return []


class _PiecesFormat:
    @zkit.hookimpl
    def zkit_register_checkpoint_formats(self):
        # detect(path, tag) looks at the tag's directory: consolidate asks (dir.parent, dir.name)
        yield CheckpointFormatRecord(name="flat", detect=lambda path, tag: (path / (tag or "") / "w.bin").is_file(),
                                     pieces=_Pieces)


def test_consolidate_reads_a_plugin_formats_pieces(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "w.bin").write_bytes(b"")
    pm = get_plugin_manager(autoload=False, extra_plugins=[_PiecesFormat()])
    state = torch.load(consolidate(tmp_path / "c", tmp_path / "out.pt", pm=pm), weights_only=True)
    assert torch.equal(state["w"], torch.arange(4.0).view(2, 2))


class _Duplicate:
    @zkit.hookimpl
    def zkit_register_checkpoint_formats(self):
        yield CheckpointFormatRecord(name="DCP", detect=lambda path, tag: False)


def test_a_duplicate_format_name_is_refused_naming_both():
    pm = get_plugin_manager(autoload=False, extra_plugins=[_Duplicate()])
    with pytest.raises(PluginError, match=r"two checkpoint format records are named 'dcp': one from 'zkit', one from 'test_checkpoint_formats'"):
        pm.checkpoint_formats()


def _deepspeed_dir(root: Path) -> Path:
    (root / "global_step3").mkdir(parents=True)
    (root / "latest").write_text("global_step3")
    (root / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"")
    return root


def test_a_deepspeed_checkpoint_without_the_dropin_names_the_distribution(tmp_path):
    ds = _deepspeed_dir(tmp_path / "ds")
    assert for_load(get_plugin_manager(), ds, None).name == "deepspeed"  # with the drop-in installed
    want = (r"holds a DeepSpeed checkpoint \(mp_rank_00_model_states.pt\); reading it needs the checkpoint format "
            r"'deepspeed', provided by the distribution 'deepspeed', which is not installed \(or is blocked\): "
            r"pip install -e plugins/zkit-deepspeed")
    with pytest.raises(CheckpointError, match=want):
        consolidate(ds, tmp_path / "m.pt", pm=get_plugin_manager(blocked=["deepspeed"]))
    message = run_ranks(cfr.load_deepspeed_without_the_dropin, 1, args=(str(ds),))[0]
    assert "reading it needs the checkpoint format 'deepspeed', provided by the distribution 'deepspeed'" in message


def test_an_operation_a_format_lacks_or_an_unknown_format_is_refused_by_name(tmp_path):
    ds = _deepspeed_dir(tmp_path / "ds")
    with pytest.raises(SystemExit, match=r"zkit consolidate: the checkpoint format 'deepspeed' \(from deepspeed "
                                         r"[^)]*\) does not provide 'export'; it provides: load, pieces"):
        cli_main(["consolidate", str(ds), str(tmp_path / "out"), "--format", "deepspeed"])
    with pytest.raises(SystemExit, match=r"unknown checkpoint format 'nope'; checkpoint formats: deepspeed, dcp, zkit, hf"):
        cli_main(["consolidate", str(ds), str(tmp_path / "out"), "--format", "nope"])


class _RecordingFormat:
    """Answers ``zkit_checkpoint_format`` for every directory with a format that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def save(self, engine, save_dir, *, tag, client_state, save_latest, exclude_frozen_parameters):
        self.calls.append(("save", Path(save_dir).name, tag, client_state, save_latest, exclude_frozen_parameters))
        return "saved"

    def load(self, engine, path, tag, *, load_optimizer_states, load_lr_scheduler_states):
        self.calls.append(("load", path.name, tag, load_optimizer_states, load_lr_scheduler_states))
        return "loaded", {"k": 1}

    @zkit.hookimpl
    def zkit_checkpoint_format(self, engine, path, tag, operation):
        self.calls.append(("asked", path.name, tag, operation))
        return CheckpointFormatRecord(name="recording", detect=lambda path, tag: True, load=self.load, save=self.save)


def _inproc_engine(stack=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return zkit.initialize(model=torch.nn.Linear(3, 2), config=cfg, stack=stack)[0]


def test_a_plugin_answering_the_format_hook_saves_and_loads(tmp_path):
    rec = _RecordingFormat()
    engine = _inproc_engine(zkit.Stack(plugins=[rec]))
    assert engine.save_checkpoint(str(tmp_path / "c"), tag="t", client_state={"a": 1}, save_latest=False) == "saved"
    assert engine.load_checkpoint(str(tmp_path / "c"), load_module_only=True) == ("loaded", {"k": 1})
    assert rec.calls == [("asked", "c", "t", "save"), ("save", "c", "t", {"a": 1}, False, False),
                         ("asked", "c", None, "load"), ("load", "c", None, False, False)]
    assert not (tmp_path / "c").exists()  # the built-in format wrote nothing


def test_without_the_checkpoint_plugin_saving_and_loading_name_the_hook(monkeypatch, tmp_path):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.checkpoint_formats")
    engine = _inproc_engine()
    for call in (engine.save_checkpoint, engine.load_checkpoint):
        with pytest.raises(RuntimeError, match=rf"engine.{call.__name__}: no plugin answers the hook "
                                               r"zkit_checkpoint_format \(the built-in zkit.checkpoint_formats "
                                               r"provides it: is it blocked\?\)"):
            call(str(tmp_path))
    assert not list(tmp_path.iterdir())


class _LoadOnlyFormat:
    """Answers ``zkit_checkpoint_format`` with a format that can only load."""

    @zkit.hookimpl
    def zkit_checkpoint_format(self, engine, path, tag, operation):
        return CheckpointFormatRecord(name="readonly", detect=lambda path, tag: True,
                                      load=lambda *a, **k: ("loaded", {}))


def test_a_plugins_format_without_the_operation_is_refused_naming_it(tmp_path):
    engine = _inproc_engine(zkit.Stack(plugins=[_LoadOnlyFormat()]))
    with pytest.raises(CheckpointError, match=r"the checkpoint format 'readonly' \(from [^)]*\) does not provide "
                                              r"'save'; it provides: load"):
        engine.save_checkpoint(str(tmp_path / "c"))
    assert engine.load_checkpoint(str(tmp_path / "c")) == ("loaded", {})
