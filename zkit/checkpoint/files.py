"""zkit's checkpoint files: atomic writes, the metadata file, the rank files (the ``"zkit"``
format's layout; which tag directory a load reads is :mod:`zkit.checkpoint.tags`)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch

from zkit.core.checkpoint_errors import CheckpointError

META = "meta.msgpack"
FORMAT = "zkit-checkpoint"
#: 2: every tensor of every rank file has a checksum in the metadata (``checksums``)
VERSION = 2


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# the process's umask, read once (reading it means setting it)
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary in the same directory and a rename."""
    _atomic(path, lambda f: f.write(data), (OSError,))


def atomic_torch_save(obj: Any, path: Path) -> None:
    # torch.save reports a failed write as a RuntimeError
    _atomic(path, lambda f: torch.save(obj, f), (OSError, RuntimeError))


def _atomic(path: Path, write: Callable[[Any], Any], failures: tuple[type[BaseException], ...]) -> None:
    """``write(file)`` into a temporary beside ``path``, flushed to disk, then renamed over it; a
    failed write names the file (and a full disk), and leaves no temporary behind."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:  # a read-only or full file system, a missing directory
        raise fs_error(path, "writing the checkpoint", exc) from exc
    try:
        try:
            # mkstemp creates the file owner-only; a checkpoint gets the mode open() would give it
            os.fchmod(fd, 0o666 & ~_UMASK)
            with os.fdopen(fd, "wb") as f:  # a Python file: a failed write raises OSError with its errno
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except failures as exc:
            raise fs_error(path, "writing the checkpoint", exc) from exc
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fs_error(path: Path, doing: str, exc: BaseException) -> CheckpointError:
    """A failed file-system step (``doing``: "writing the checkpoint") that names the path and,
    when the disk is full, says so (torch's own message for a failed write is 'basic_ios::clear:
    iostream error')."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full and doing.startswith("writing"):
        with contextlib.suppress(OSError):
            full = shutil.disk_usage(path.parent).free < (1 << 20)
    if full:
        return CheckpointError(f"{path}: no space left on device while {doing}; free space and save again")
    if isinstance(cause, OSError) and cause.strerror:
        return CheckpointError(f"{path}: {doing} failed ({cause.strerror})")
    return CheckpointError(f"{path}: {doing} failed ({type(exc).__name__}: {exc})")


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


def file_digests(meta: dict[str, Any], fname: str, where: Path) -> dict[str, str] | None:
    """The saved checksums of rank file ``fname`` (None for a version-1 checkpoint, written
    before checksums existed)."""
    if meta.get("version", 1) < 2:
        return None
    table = meta.get("checksums", {}).get(fname)
    if table is None:
        raise CheckpointError(f"{where / META}: no checksums for {fname}")
    return table


def load_rank_file(path: Path) -> dict[str, Any]:
    """Read one rank file (mapped, ``weights_only``), unverified: the loader verifies each tensor
    as it copies it out (:class:`zkit.checkpoint.digest.VerifiedCopies`)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint shard is missing")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint shard ({type(exc).__name__}: {exc})") from exc
    return data
