"""Sharded, reshardable checkpoints.

A checkpoint ``<dir>/<tag>/`` holds one ``rank_XXXXX.pt`` per writing rank and ``meta.msgpack``.
Rank files hold *pieces*: element ranges ``[start, end)`` of flattened parameters, with their fp32
master values and optimizer state. The metadata indexes which file holds which pieces. Loading
copies, for every piece the loading rank owns now, the overlapping saved ranges from whichever files
hold them, so a checkpoint loads at any world size and any stage (resharding happens at load,
online). Files are written to temporaries and renamed; the tag directory is renamed into place
whole; ``latest`` is written last: a crash mid-save leaves the previous checkpoint intact. Loading
uses ``torch.load(weights_only=True)``.

A model split over model-parallel ranks (pipeline stages, tensor slices) writes one such sharded
checkpoint per part, in ``<dir>/<tag>/<part>/``, under one tag (:mod:`zkit.checkpoint.parts`).

This is the ``"zkit"`` checkpoint format; the engine and ``zkit consolidate`` reach it, DCP, the
Hugging Face export and any format a plugin registers through :mod:`zkit.checkpoint.formats`.
"""
from zkit.checkpoint.consolidate import consolidate
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.load import load_checkpoint
from zkit.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "consolidate", "load_checkpoint", "save_checkpoint"]
