"""Rank function for the checkpoint fault tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import errno
from pathlib import Path

import torch

import zkit
import zkit.checkpoint.save as save
from zkit.checkpoint import CheckpointError
from zkit.checkpoint.files import _write_error


def save_with_a_full_disk_on_rank_1(save_dir: str) -> str:
    """Rank 1's write fails as on a full disk: every rank's save raises, naming rank 1's file."""
    engine, *_ = zkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}})
    if engine.rank == 1:
        def full(obj, path: Path) -> None:
            raise _write_error(path, OSError(errno.ENOSPC, "No space left on device"))

        save.atomic_torch_save = full
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()
    return "saved"
