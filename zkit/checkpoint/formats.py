"""Which checkpoint format a directory holds, and that format's operations.

Checkpoint formats are records of the ``zkit_register_checkpoint_formats`` hook
(:class:`zkit.core.records.CheckpointFormatRecord`): zkit's own (``"zkit"``), PyTorch Distributed
Checkpoint (``"dcp"``) and Hugging Face's ``save_pretrained`` (``"hf"``) are built in; the
``deepspeed`` drop-in adds ``"deepspeed"``. :func:`zkit.checkpoint.consolidate` and ``zkit
consolidate --format NAME`` reach a format through here, and so do ``engine.load_checkpoint`` and
``engine.save_checkpoint``, through the built-in answer to the ``zkit_checkpoint_format`` hook
(:mod:`zkit.checkpoint.plugin`); so a format a plugin registers is used by all of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.tags import resolve_tag, tag_directory
from zkit.core.plugin_manager import ZkitPluginManager, get_plugin_manager
from zkit.core.records import CheckpointFormatRecord

#: the format ``engine.save_checkpoint`` writes, and the one a directory no format recognises is
#: read as (its errors say what is missing)
NATIVE = "zkit"


@attrs.frozen
class KnownLayout:
    """A format a separate distribution reads, recognised by file names only, so that loading it
    without that distribution names what to install instead of failing as a zkit checkpoint."""

    format: str
    what: str
    dist: str
    install: str
    patterns: tuple[str, ...]

    def matches(self, where: Path) -> str | None:
        """The name of a file in ``where`` that looks like this layout, or None. Asked only about a
        directory no installed format recognised (a zkit checkpoint, with its metadata file, is
        recognised by the ``"zkit"`` format first)."""
        if not where.is_dir():
            return None
        return next((p.name for pattern in self.patterns for p in sorted(where.glob(pattern))), None)


KNOWN_LAYOUTS = (
    KnownLayout("deepspeed", "a DeepSpeed checkpoint", "deepspeed", "pip install -e plugins/zkit-deepspeed",
                ("mp_rank_*_model_states.pt", "zero_pp_rank_*_model_states.pt", "layer_*-model_states.pt")),
)


def formats(pm: ZkitPluginManager | None = None) -> dict[str, CheckpointFormatRecord]:
    """Every checkpoint format, installed plugins' first."""
    return (pm or get_plugin_manager()).checkpoint_formats()


def named(pm: ZkitPluginManager | None, name: str) -> CheckpointFormatRecord:
    """The format called ``name``; an unknown name lists the known ones (and the distribution to
    install for a format zkit knows another distribution provides)."""
    found = formats(pm)
    key = name.strip().lower()
    if key in found:
        return found[key]
    msg = f"unknown checkpoint format {name!r}; checkpoint formats: {', '.join(found) or '(none)'}"
    for known in KNOWN_LAYOUTS:
        if known.format == key:
            msg += f". The format {key!r} is provided by the distribution {known.dist!r}: {known.install}"
    raise CheckpointError(msg)


def detect(pm: ZkitPluginManager | None, path: Path, tag: str | None, op: str) -> CheckpointFormatRecord | None:
    """The first format providing ``op`` whose ``detect(path, tag)`` recognises the directory."""
    for record in formats(pm).values():
        if getattr(record, op) is not None and record.detect(path, tag):
            return record
    return None


def for_load(pm: ZkitPluginManager | None, path: Path, tag: str | None) -> CheckpointFormatRecord:
    """The format ``engine.load_checkpoint(path, tag)`` loads with: the first that recognises the
    directory, else the native one (whose ``load`` warns and loads nothing when there is nothing to
    load: no tag and no ``latest`` file)."""
    found = detect(pm, path, tag, "load")
    if found is not None:
        return found
    where = tag_directory(path, tag)  # None without a tag and a ``latest`` file
    if where is not None:
        refuse_unreadable(where)
    return named(pm, NATIVE)


def refuse_unreadable(where: Path) -> None:
    """Refuse a directory in a layout that a distribution which is not installed reads."""
    for known in KNOWN_LAYOUTS:
        example = known.matches(where)
        if example is not None:
            raise CheckpointError(
                f"{where}: holds {known.what} ({example}); reading it needs the checkpoint format "
                f"{known.format!r}, provided by the distribution {known.dist!r}, which is not installed "
                f"(or is blocked): {known.install}"
            )


def open_pieces(pm: ZkitPluginManager | None, checkpoint_dir: Path, tag: str | None) -> Any:
    """The checkpoint at ``checkpoint_dir`` (the directory given to ``save_checkpoint``, with
    ``tag`` or its ``latest`` file, or one tag's directory) as a
    :class:`zkit.checkpoint.piece_source.PieceSource`, through its format's ``pieces``."""
    if tag is None:
        record = detect(pm, checkpoint_dir.parent, checkpoint_dir.name, "pieces")
        if record is not None:  # one tag's directory itself
            return record.pieces(checkpoint_dir)
    tag = resolve_tag(checkpoint_dir, tag)
    where = checkpoint_dir / tag
    record = detect(pm, checkpoint_dir, tag, "pieces")
    if record is None:
        refuse_unreadable(where)
        record = named(pm, NATIVE)
    return record.operation("pieces")(where)
