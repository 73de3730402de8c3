"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a ZeRO checkpoint, DeepSpeed's names
and signatures (0.19.8), over zkit's checkpoints and DeepSpeed's own.

The tensors stream through :mod:`zkit.checkpoint.consolidate` (a chunk at a time from the
memory-mapped shards to the output file): ``convert_*`` write the output files that way, and
``get_fp32_state_dict_from_zero_checkpoint`` writes one temporary ``.pt`` file and maps it, so the
state dict it returns is backed by the file's pages rather than held twice in memory (DeepSpeed's
``lazy_mode``, always).

``get_optim_files`` / ``get_model_state_file`` give DeepSpeed's file names. For a zkit checkpoint,
which has no such files, they return small stand-ins written to a temporary directory that hold
what code reads from those files besides tensors: the ZeRO stage and world size (optimizer file),
the engine's counters and the client state at the top level (model file). Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` reads exactly these.

    python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [-t TAG]
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from zkit.checkpoint import (
    META,
    Plan,
    PlannedTensor,
    load_rank_file,
    plan_consolidation,
    rank_file,
    read_latest,
    read_meta,
    write_planned,
)
from zkit.core.checkpoint_errors import CheckpointError
from zkit_deepspeed.checkpoint.layout import looks_like_deepspeed

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_checkpoint_files", "get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file",
           "get_model_state_files", "get_optim_files", "load_state_dict_from_zero_checkpoint"]

OUTPUT_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_ZKIT_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = dtype[6:] if isinstance(dtype, str) and dtype.startswith("torch.") else dtype
    resolved = OUTPUT_DTYPE_NAMES.get(name.lower()) if isinstance(name, str) else name
    if resolved not in _ZKIT_DTYPE:
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return resolved


def _tag_directory(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """``checkpoint_dir/tag``, the tag read from ``latest`` when not given (DeepSpeed's errors)."""
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        tag = read_latest(latest)
    where = root / tag
    if not where.is_dir():
        raise FileNotFoundError(f"Directory '{where}' doesn't exist")
    return where


def _frozen_names(plan: Plan) -> set[str]:
    """The names among the plan's module extras that are frozen parameters, not buffers."""
    files = plan.files
    if hasattr(files, "ckpt"):  # a DeepSpeed checkpoint: its model file names the buffers
        model_state = files.ckpt.model_state
        buffers = set(model_state.get("buffer_names") or [])
        return {e.name for e in plan.entries if not e.is_param and e.canonical not in buffers}
    frozen = files.meta.get("frozen_parameters")
    if frozen is None:
        raise CheckpointError(f"{plan.where}: written by a zkit that did not record which saved tensors are frozen "
                              f"parameters; convert it without exclude_frozen_parameters")
    return set(frozen)


def _plan(checkpoint_dir: str | os.PathLike[str], tag: str | None, exclude_frozen_parameters: bool,
          dtype: torch.dtype, safetensors: bool) -> tuple[Plan, list[PlannedTensor]]:
    plan = plan_consolidation(_tag_directory(checkpoint_dir, tag), dtype=_ZKIT_DTYPE[dtype], safetensors=safetensors)
    entries = plan.entries
    if exclude_frozen_parameters:
        frozen = _frozen_names(plan)
        entries = [e for e in entries if e.name not in frozen and e.canonical not in frozen]
    return plan, entries


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 state dict of the checkpoint in ``checkpoint_dir`` (tag from ``latest`` unless
    given): every ``model.state_dict()`` key, tied names sharing one tensor; frozen parameters
    left out with ``exclude_frozen_parameters``. The tensors are mapped from a temporary file
    (see the module docstring); ``lazy_mode`` changes nothing (``.contiguous()`` on a tensor, as
    DeepSpeed's lazy tensors are read, gives the tensor)."""
    plan, entries = _plan(checkpoint_dir, tag, exclude_frozen_parameters, torch.float32, safetensors=False)
    with tempfile.TemporaryDirectory(prefix="zkit-zero-to-fp32-") as scratch:
        path = Path(scratch) / "state.pt"
        write_planned(plan, entries, path)
        # the mapping outlives the file's name; its pages are the file's, not copies
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                                          dtype: str | torch.dtype = torch.float32,
                                          max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> None:
    """Write the checkpoint's state dict to ``output_dir`` as ``pytorch_model.bin`` (or
    ``model.safetensors``), split into shards of at most ``max_shard_size`` with an index file
    the way Hugging Face names them (``None``: one file); floating-point tensors in ``dtype``."""
    dtype = _output_dtype(dtype)
    plan, entries = _plan(checkpoint_dir, tag, exclude_frozen_parameters, dtype, safetensors=safe_serialization)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards, index = _split(entries, weights_name, max_shard_size)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {e.name: e for e in entries}
    for fname, names in shards.items():
        staging = Path(tempfile.mkdtemp(dir=out, prefix=f".{fname}."))  # the file's own name: its format
        try:
            write_planned(plan, [by_name[n] for n in names], staging / fname)  # in the shard's order, as DeepSpeed's
            os.replace(staging / fname, out / fname)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if index is not None:
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        (out / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str],
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                          max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                                          tag=tag, exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (not strictly,
    as DeepSpeed does); returns the model."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def _split(entries: list[PlannedTensor], weights_name: str,
           max_shard_size: int | str | None) -> tuple[dict[str, list[str]], dict[str, Any] | None]:
    """Shard file name -> names, and the index (None when unsharded), by Hugging Face's rule
    (``huggingface_hub.split_torch_state_dict_into_shards``, as DeepSpeed uses)."""
    if max_shard_size is None:
        return {weights_name: [e.name for e in entries]}, None
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as exc:
        raise ImportError("max_shard_size needs huggingface_hub (pip install huggingface_hub), "
                          "or pass max_shard_size=None for one file") from exc
    # untouched empty tensors: sizes without the bytes; tied names share one, as in the real state dict
    empty: dict[str, torch.Tensor] = {}
    state = {e.name: empty.setdefault(e.canonical, torch.empty(e.shape, dtype=e.dtype, device="cpu")) for e in entries}
    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
    shards = {f: list(names) for f, names in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return shards, None
    return shards, {"metadata": split.metadata, "weight_map": split.tensor_to_filename}


# -- DeepSpeed's file helpers ------------------------------------------------------------------------

def _natural_keys(text: str) -> list[Any]:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files in ``checkpoint_dir`` matching ``glob_pattern``, in natural order."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_keys)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The ZeRO optimizer files of one tag's directory (a zkit checkpoint: a stand-in, see above)."""
    view = _zkit_view(Path(checkpoint_dir))
    return get_checkpoint_files(view or checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    view = _zkit_view(Path(checkpoint_dir))
    return get_checkpoint_files(view or checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The model file DeepSpeed writes on rank 0 at ``zero_stage`` (a zkit checkpoint: a stand-in)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    view = _zkit_view(Path(checkpoint_dir))
    name = "mp_rank_00_model_states.pt" if zero_stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(view or checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


_VIEWS: dict[Path, tuple[float, Path]] = {}


def _zkit_view(where: Path) -> Path | None:
    """For a zkit checkpoint's tag directory, a directory of DeepSpeed-named stand-in files (made
    once per checkpoint and process, removed at exit); None for anything else."""
    if not (where / META).is_file() or looks_like_deepspeed(where):
        return None
    stamp = (where / META).stat().st_mtime
    key = where.resolve()
    if key in _VIEWS and _VIEWS[key][0] == stamp:
        return _VIEWS[key][1]
    meta = read_meta(where)
    first = load_rank_file(where / rank_file(0))
    view = Path(tempfile.mkdtemp(prefix="zkit-deepspeed-view-"))
    atexit.register(shutil.rmtree, view, True)
    stage, world = int(meta["stage"]), int(meta["world_size"])
    for rank in range(world):
        torch.save({"optimizer_state_dict": {"zero_stage": stage, "partition_count": world}},
                   view / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    model_state = {
        "global_steps": meta.get("global_steps", 0), "global_samples": meta.get("global_samples", 0),
        "skipped_steps": meta.get("skipped_steps", 0), "dp_world_size": world, "mp_world_size": 1,
        **({"lr_scheduler": first["lr_scheduler"]} if "lr_scheduler" in first else {}),
        **first.get("client_state", {}),
    }
    torch.save(model_state, view / ("mp_rank_00_model_states.pt" if stage <= 2 else
                                    "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    _VIEWS[key] = (stamp, view)
    return view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a ZeRO checkpoint's fp32 state dict (zkit or DeepSpeed).")
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="where to write pytorch_model.bin or model.safetensors (and shards)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
