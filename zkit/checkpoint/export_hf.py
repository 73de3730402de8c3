"""A checkpoint as a Hugging Face ``save_pretrained`` directory: ``config.json`` and the weights as
safetensors, sharded with an index when they exceed one shard, so that
``AutoModel.from_pretrained(dir)`` (or the model's own class) loads them.

    write_hf_pretrained("ckpt", "export/", config="path/to/model_dir_or_config.json", dtype="bf16")

Written the way :mod:`zkit.checkpoint.consolidate` writes one file: every shard's layout is fixed
first and its tensors streamed in at their offsets, so memory stays near one chunk whatever the
model's size. As ``save_pretrained`` does, a tied weight is written once, under the name the model
reaches it by first (``transformer.wte.weight``, not ``lm_head.weight``); ``from_pretrained`` ties it
again from the config. The checkpoint itself does not know the model's configuration, so
``config`` names it: a ``save_pretrained`` directory (its ``config.json`` and, when there,
``generation_config.json`` are copied) or a ``config.json`` file.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import attrs

from zkit.checkpoint.consolidate import PlannedTensor, plan_consolidation, write_planned
from zkit.core.checkpoint_errors import CheckpointError
from zkit.core.plugin_manager import ZkitPluginManager

#: ``save_pretrained``'s file names
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
#: the largest shard, in bytes of tensor data (``save_pretrained``'s ``max_shard_size`` default)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@attrs.frozen
class Exported:
    """What :func:`write_hf_pretrained` wrote."""

    directory: Path
    shards: tuple[str, ...]
    tensors: int
    #: tied names left out (the model ties them again when it loads)
    tied: tuple[str, ...]
    nbytes: int
    dtype: str

    def summary(self) -> str:
        return (f"wrote {self.directory}: {self.tensors} tensors in {len(self.shards)} safetensors shard(s), "
                f"{self.nbytes:,} bytes ({self.dtype}); tied names left for the model to re-tie: "
                f"{', '.join(self.tied) or 'none'}")


def looks_like_hf(where: Path) -> bool:
    """Whether ``where`` is a ``save_pretrained`` directory (``config.json`` and safetensors weights)."""
    return (where / "config.json").is_file() and ((where / WEIGHTS).is_file() or (where / INDEX).is_file())


def _config_files(config: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """``(source, name in the export)`` of the configuration files."""
    src = Path(config)
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise CheckpointError(f"{src}: no config.json (give a save_pretrained directory or a config.json file)")
        return [(src / name, name) for name in CONFIG_FILES if (src / name).is_file()]
    if src.is_file() and src.suffix == ".json":
        try:
            json.loads(src.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{src}: not valid JSON ({exc})") from None
        return [(src, "config.json")]
    raise CheckpointError(f"{src}: not a directory with config.json nor a .json file")


def _shards(entries: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Entries in order, cut into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_hf_pretrained(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    config: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    pm: ZkitPluginManager | None = None,
) -> Exported:
    """Write the checkpoint at ``checkpoint_dir`` (of any format providing ``pieces``: zkit's,
    DeepSpeed's with the drop-in) as a ``save_pretrained`` directory ``out_dir``; ``dtype``
    ("fp32", "fp16", "bf16") for floating-point tensors; ``max_shard_bytes`` (default
    :data:`DEFAULT_MAX_SHARD_BYTES`) the largest shard. The directory is written next to
    ``out_dir`` and renamed into place whole. ``pm``: the plugin manager whose checkpoint formats
    read the checkpoint (default: a new one)."""
    max_shard_bytes = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    config_files = _config_files(config)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; export into a new directory")
    plan = plan_consolidation(checkpoint_dir, tag=tag, dtype=dtype, safetensors=True, pm=pm)
    kept = [e for e in plan.entries if e.name == e.canonical]  # a tied alias is the model's to re-tie
    tied = tuple(e.name for e in plan.entries if e.name != e.canonical)
    shards = _shards(kept, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for name, shard in zip(names, shards):
            write_planned(plan, shard, staging / name)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in kept)},
                "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
            }
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for source, name in config_files:
            shutil.copyfile(source, staging / name)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(directory=out, shards=tuple(names), tensors=len(kept), tied=tied,
                    nbytes=sum(e.nbytes for e in kept), dtype=plan.dtype)
