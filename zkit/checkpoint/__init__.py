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

The public names below are what other packages use: saving, loading and consolidating whole
checkpoints, writing one as PyTorch's Distributed Checkpoint (:func:`write_dcp`) or a Hugging Face
``save_pretrained`` directory (:func:`write_hf_pretrained`); and, for a format that reads another layout into zkit's pieces (the drop-in's
DeepSpeed checkpoints), the rank files and metadata (``META``, :func:`rank_file`,
:func:`read_meta`, :func:`load_rank_file`), tags (:func:`read_latest`, :func:`tag_directory`), the
copy of saved ranges into the pieces a rank owns (:func:`fill_pieces`), the checks a load makes
(:func:`check_params`, :func:`check_module_extras`, :func:`load_module_extras`) and a
consolidation's plan (:func:`plan_consolidation`, :class:`Plan`, :class:`PlannedTensor`,
:func:`write_planned`).
"""
from zkit.checkpoint.consolidate import Plan, PlannedTensor, consolidate, plan_consolidation, write_planned
from zkit.checkpoint.dcp import write_dcp
from zkit.checkpoint.export_hf import write_hf_pretrained
from zkit.checkpoint.files import META, load_rank_file, rank_file, read_meta
from zkit.checkpoint.fill import fill_pieces
from zkit.checkpoint.load import check_module_extras, check_params, load_checkpoint, load_module_extras
from zkit.checkpoint.save import save_checkpoint
from zkit.checkpoint.tags import read_latest, tag_directory
from zkit.core.checkpoint_errors import CheckpointError

__all__ = [
    "META",
    "CheckpointError",
    "Plan",
    "PlannedTensor",
    "check_module_extras",
    "check_params",
    "consolidate",
    "fill_pieces",
    "load_checkpoint",
    "load_module_extras",
    "load_rank_file",
    "plan_consolidation",
    "rank_file",
    "read_latest",
    "read_meta",
    "save_checkpoint",
    "tag_directory",
    "write_dcp",
    "write_hf_pretrained",
    "write_planned",
]
