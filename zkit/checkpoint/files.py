"""File-level helpers: atomic writes, safe reads, the metadata format."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import torch

from zkit.checkpoint.errors import CheckpointError

META = "meta.msgpack"
LATEST = "latest"
FORMAT = "zkit-checkpoint"
VERSION = 1


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    atomic_write_bytes(path, msgpack.packb(meta, use_bin_type=True))


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint metadata (is {directory} a zkit checkpoint?)")
    try:
        meta = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except Exception as exc:  # truncated or not msgpack
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zkit checkpoint (format {meta.get('format') if isinstance(meta, dict) else '?'!r})")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer zkit (format version {meta['version']} > {VERSION})")
    return meta


def load_rank_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint shard is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint shard ({type(exc).__name__}: {exc})") from exc


def resolve_tag(load_dir: Path, tag: str | None) -> str:
    if tag is not None:
        return tag
    latest = load_dir / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{latest}: no 'latest' file; pass tag= to load a specific checkpoint")
    return latest.read_text().strip()
