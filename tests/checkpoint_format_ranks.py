"""Rank functions of tests/test_checkpoint_formats.py (module level: ranks are spawned processes)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

import zkit
from zkit.checkpoint import CheckpointError
from zkit.core.records import CheckpointFormatRecord

MARKER = "acme.index"


class AcmeFormat:
    """A third-party checkpoint format: a directory holding ``acme.index``; its load sets every
    parameter to the number written in the index and records how it was called."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def load(self, engine, path: Path, tag, *, load_optimizer_states, load_lr_scheduler_states):
        value = float((path / MARKER).read_text())
        for piece in engine.partitioner.pieces():
            piece.master.fill_(value)
        engine.partitioner.after_load(engine.partitioner.pieces())
        self.calls.append({"tag": tag, "optim": load_optimizer_states, "lr": load_lr_scheduler_states})
        return str(path), {"from": "acme"}

    @zkit.hookimpl
    def zkit_register_checkpoint_formats(self):
        yield CheckpointFormatRecord(name="acme", detect=lambda path, tag: (path / MARKER).is_file(), load=self.load)


def _engine(plugins=()):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "steps_per_print": 1000}
    engine, *_ = zkit.initialize(model=model, config=cfg, stack=zkit.Stack(plugins=list(plugins)))
    return engine


def load_with_a_plugin_format(acme_dir: str, zkit_dir: str) -> dict:
    acme = AcmeFormat()
    engine = _engine([acme])
    path, client = engine.load_checkpoint(acme_dir, load_module_only=True)
    weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.save_checkpoint(zkit_dir, tag="t")  # the built-in format still saves and loads beside it
    _, zkit_client = engine.load_checkpoint(zkit_dir)
    return {"path": path, "client": client, "calls": acme.calls, "weights": weights, "zkit_client": zkit_client}


def load_deepspeed_without_the_dropin(ds_dir: str) -> str:
    os.environ["ZKIT_BLOCK_PLUGINS"] = "deepspeed"
    engine = _engine()
    try:
        engine.load_checkpoint(ds_dir)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"
