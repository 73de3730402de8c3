"""Recognising a DeepSpeed checkpoint directory and naming its files.

``engine.save_checkpoint(dir)`` in DeepSpeed writes ``dir/latest`` (the tag) and ``dir/<tag>/``
holding, for a model that is not split over model-parallel ranks:

- ``mp_rank_00_model_states.pt`` (stages 0-2): the module's state dict in its training dtype, the
  names and shapes of the trainable parameters in flattening order (``param_shapes``), counters,
  LR scheduler and client state; at stage 3 one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  per data-parallel rank, the same with the parameters left out (buffers only);
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (stages 1-3): its
  partition of the fp32 master weights and of the optimizer state;
- for a ``PipelineModule``, ``layer_<XX>-model_states.pt`` per layer instead of the module, and
  the model and optimizer files above once per pipeline stage (``mp_rank_<stage>``).
"""
from __future__ import annotations

import re
from pathlib import Path

import attrs

from zkit.core.checkpoint_errors import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
_ZERO_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PLAIN_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$|^layer_(\d+)-model_states\.pt$")


@attrs.frozen
class Layout:
    """The files of one DeepSpeed checkpoint tag."""

    #: ``<dir>/<tag>``
    where: Path
    #: the model states files: one (stages 0-2) or one per data-parallel rank (stage 3)
    model_files: tuple[Path, ...]
    #: the ZeRO optimizer files in data-parallel rank order (none at stage 0 without bf16)
    optim_files: tuple[Path, ...]
    #: ``layer_XX-model_states.pt`` of a pipeline run, in layer order
    layer_files: tuple[Path, ...]


def looks_like_deepspeed(where: Path) -> bool:
    """Whether ``where`` (one tag's directory) holds DeepSpeed checkpoint files."""
    if not where.is_dir():
        return False
    return any(_ZERO_MODEL.match(p.name) or _PLAIN_MODEL.match(p.name) or _LAYER.match(p.name) for p in where.iterdir())


def detect(where: Path) -> Layout:
    """The files of the DeepSpeed checkpoint in ``where``, checked to be complete."""
    names = sorted(p.name for p in where.iterdir())
    mp_ranks = {int(m.group(1)) for n in names if (m := _PLAIN_MODEL.match(n))}
    mp_ranks |= {int(m.group(2)) for n in names if (m := _ZERO_MODEL.match(n))}
    mp_ranks |= {int(m.group(3)) for n in names if (m := _OPTIM.match(n))}
    layers = [n for n in names if _LAYER.match(n)]
    if mp_ranks - {0} and not layers:
        raise CheckpointError(
            f"{where}: a DeepSpeed checkpoint of a model split over {max(mp_ranks) + 1} tensor-parallel ranks "
            f"(mp_rank_00..{max(mp_ranks):02d}); importing tensor-parallel checkpoints is not supported: "
            f"convert it with DeepSpeed's universal checkpoint (ds_to_universal.py) at tensor-parallel degree 1 first"
        )
    if any(_LAYER.match(n) and _LAYER.match(n).group(2) not in (None, "00") for n in layers):
        raise CheckpointError(f"{where}: pipeline layers split over tensor-parallel ranks (layer_XX-model_YY) are not supported")

    zero_models = sorted((int(m.group(1)), n) for n in names if (m := _ZERO_MODEL.match(n)) and m.group(2) == "00")
    optims = sorted((int(m.group(2)), n) for n in names if (m := _OPTIM.match(n)) and m.group(3) == "00")
    if zero_models:
        model_files = tuple(where / n for _, n in zero_models)
        _check_consecutive(where, [r for r, _ in zero_models], "zero_pp_rank_{}_mp_rank_00_model_states.pt")
    elif MODEL_FILE in names:
        model_files = (where / MODEL_FILE,)
    else:
        raise CheckpointError(f"{where}: no {MODEL_FILE} (nor zero_pp_rank_0_mp_rank_00_model_states.pt): not a complete DeepSpeed checkpoint")
    _check_consecutive(where, [r for r, _ in optims], "zero_pp_rank_{}_mp_rank_00_optim_states.pt")
    if len({bool(_OPTIM.match(n).group(1)) for _, n in optims}) > 1:
        raise CheckpointError(f"{where}: both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files: two saves mixed in one directory")
    return Layout(
        where=where,
        model_files=model_files,
        optim_files=tuple(where / n for _, n in optims),
        layer_files=tuple(where / n for n in sorted(layers, key=lambda n: int(re.findall(r"\d+", n)[0]))),
    )


def pipeline_stages(where: Path) -> list[Layout]:
    """One layout per stage of a ``PipelineModule`` checkpoint: stage ``s`` wrote
    ``mp_rank_<s>_model_states.pt`` and its data-parallel ranks ``d`` wrote
    ``[bf16_]zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt`` (the layer files are shared)."""
    names = sorted(p.name for p in where.iterdir())
    stages = sorted(int(m.group(1)) for n in names if (m := _PLAIN_MODEL.match(n)))
    if not stages:
        raise CheckpointError(f"{where}: layer files but no {MODEL_FILE}: not a complete DeepSpeed pipeline checkpoint")
    _check_consecutive(where, stages, "mp_rank_{:02d}_model_states.pt")
    out = []
    for s in stages:
        optims = sorted((int(m.group(2)), n) for n in names if (m := _OPTIM.match(n)) and int(m.group(3)) == s)
        _check_consecutive(where, [r for r, _ in optims], f"zero_pp_rank_{{}}_mp_rank_{s:02d}_optim_states.pt")
        out.append(Layout(where=where, model_files=(where / f"mp_rank_{s:02d}_model_states.pt",),
                          optim_files=tuple(where / n for _, n in optims), layer_files=()))
    return out


def _check_consecutive(where: Path, ranks: list[int], pattern: str) -> None:
    missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
    if missing:
        raise CheckpointError(f"{where}: {pattern.format(missing[0])} is missing (found ranks {ranks})")
