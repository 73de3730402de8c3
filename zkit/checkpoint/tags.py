"""Which tag directory of a checkpoint directory a load reads: the tag given, or the one its
``latest`` file names (the layout of every tagged format, zkit's and the DeepSpeed drop-in's)."""
from __future__ import annotations

from pathlib import Path

from zkit.core.checkpoint_errors import CheckpointError

LATEST = "latest"


def read_latest(latest: Path) -> str:
    """The tag a ``latest`` file names: UTF-8 text without NUL bytes (a file that is not, e.g.
    overwritten by a crash or another program, is refused naming it)."""
    data = latest.read_bytes()
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{latest}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); it should hold the tag "
            f"of the latest checkpoint: rewrite it, or pass tag= to load a specific checkpoint"
        ) from None
    if "\0" in tag:
        raise CheckpointError(
            f"{latest}: holds a NUL byte (at offset {data.index(0)}); it should hold the tag of the latest "
            f"checkpoint: rewrite it, or pass tag= to load a specific checkpoint"
        )
    return tag


def tag_directory(path: Path, tag: str | None) -> Path | None:
    """The directory ``load_checkpoint(path, tag)`` reads: ``path/tag``, else ``path/<the tag in
    latest>``; ``None`` without a tag and a ``latest`` file. Unchecked (see :func:`resolve_tag`):
    for a checkpoint format's ``detect``."""
    if tag is not None:
        return path / tag
    latest = path / LATEST
    return path / read_latest(latest) if latest.is_file() else None


def resolve_tag(load_dir: Path, tag: str | None) -> str:
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{latest}: no 'latest' file; pass tag= to load a specific checkpoint")
        tag = read_latest(latest)
        source = f"{latest} names tag {tag!r}, which"
    else:
        source = f"tag {tag!r}"
    # A tag is a directory name inside load_dir: never a path that leads elsewhere.
    target = (load_dir / tag).resolve()
    if not tag or target.parent != load_dir.resolve():
        raise CheckpointError(f"{source} is not a checkpoint directory inside {load_dir}")
    return tag
