"""How a save puts a checkpoint in place so that a kill at any moment leaves a loadable one.

A save writes everything into ``<dir>/.<tag>.partial`` (the staging directory), then the first
rank *commits* it: an existing ``<dir>/<tag>`` is renamed aside to ``<dir>/.<tag>.old``, the staging
directory renamed to ``<dir>/<tag>``, the old one removed (its metadata file first, so that a
directory left half removed never looks complete), and ``latest`` rewritten (through a temporary
and a rename). A tag directory is complete when it has its metadata file: it is only ever renamed
into place whole, and is removed metadata first.

A kill between the two renames of an overwrite leaves no ``<tag>`` but a complete ``.<tag>.old``:
loading finds it there (:func:`loadable_directory`, with a warning), and the next save into the
directory first puts it back (:func:`restore_interrupted`), so no later save removes the only
complete copy. Staging directories and ``latest`` temporaries left by a killed save are removed by
the next save.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from zkit.checkpoint.files import META, atomic_write_bytes, fs_error
from zkit.checkpoint.tags import LATEST

log = logging.getLogger("zkit")

STAGING_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"


def staging_directory(root: Path, tag: str) -> Path:
    return root / f".{tag}{STAGING_SUFFIX}"


def aside_directory(root: Path, tag: str) -> Path:
    """Where an overwrite keeps the previous ``<tag>`` until the new one is in place."""
    return root / f".{tag}{ASIDE_SUFFIX}"


def is_complete(where: Path) -> bool:
    return (where / META).is_file()


def remove_checkpoint(where: Path) -> None:
    """Remove a checkpoint directory, its metadata first (a removal cut short leaves a directory
    that is not complete). Failures are ignored: what is left is disk space, never a checkpoint."""
    with contextlib.suppress(OSError):
        (where / META).unlink()
    shutil.rmtree(where, ignore_errors=True)


def loadable_directory(root: Path, tag: str) -> Path:
    """``root/tag``; or, when it is missing or incomplete because a save overwriting ``tag`` was
    killed between its renames, the previous checkpoint that save had set aside."""
    where, aside = root / tag, aside_directory(root, tag)
    if is_complete(where) or not is_complete(aside):
        return where
    log.warning(
        "%s is %s: a save overwriting tag %r was interrupted; loading the checkpoint it replaced, %s (the next "
        "save into %s puts it back in place)", where, "incomplete" if where.exists() else "missing", tag, aside, root,
    )
    return aside


def prepare(root: Path, tag: str) -> Path:
    """On the first rank, before a save writes anything: create ``root``, undo interrupted
    overwrites, remove what killed saves left, create the staging directory; return it. A failure
    names the path (e.g. a read-only directory)."""
    staging = staging_directory(root, tag)
    _step(root, "creating the checkpoint directory", lambda: root.mkdir(parents=True, exist_ok=True))
    restore_interrupted(root)
    for stale in root.glob(f".*{STAGING_SUFFIX}"):  # a save that died: never a checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*"):  # the temporary of a 'latest' being written
        with contextlib.suppress(OSError):
            stale.unlink()
    _step(staging, "creating the checkpoint's staging directory", staging.mkdir)
    return staging


def restore_interrupted(root: Path) -> None:
    """Put back every checkpoint an overwrite set aside and did not replace (the overwrite was
    killed between its renames); remove those it did replace."""
    for aside in root.glob(f".*{ASIDE_SUFFIX}"):
        tag = aside.name[1 : -len(ASIDE_SUFFIX)]
        final = root / tag
        if is_complete(final) or not aside.is_dir():
            remove_checkpoint(aside)
            continue
        log.warning("%s is %s: putting back the checkpoint an interrupted save of tag %r set aside (%s)",
                    final, "incomplete" if final.exists() else "missing", tag, aside)
        if final.exists():
            remove_checkpoint(final)
        _step(final, "putting back the previous checkpoint", lambda: os.rename(aside, final))


def commit(root: Path, tag: str, save_latest: bool) -> Path:
    """On the first rank, once every file of the save is in the staging directory: rename it into
    place (the previous ``<tag>`` aside, then removed) and write ``latest``; return ``root/tag``.
    A failed rename puts the previous checkpoint back."""
    staging, final, aside = staging_directory(root, tag), root / tag, aside_directory(root, tag)
    moved = False
    if final.exists():  # ``prepare`` left no aside directory
        _step(final, "setting the previous checkpoint aside", lambda: os.rename(final, aside))
        moved = True
    try:
        _step(final, "renaming the checkpoint into place", lambda: os.rename(staging, final))
    except Exception:
        if moved:
            with contextlib.suppress(OSError):
                os.rename(aside, final)
        raise
    if moved:
        remove_checkpoint(aside)
    if save_latest:
        atomic_write_bytes(root / LATEST, tag.encode())
    return final


def _step(path: Path, doing: str, action) -> None:
    try:
        action()
    except OSError as exc:
        raise fs_error(path, doing, exc) from exc
