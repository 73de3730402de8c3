"""zkit's built-in checkpoint formats: its own sharded format (``"zkit"``), PyTorch Distributed
Checkpoint (``"dcp"``, what torchtitan and FSDP2 save) both ways, and Hugging Face's
``save_pretrained`` directory (``"hf"``, export only); which of them ``engine.save_checkpoint`` and
``engine.load_checkpoint`` use (:mod:`zkit.checkpoint.formats`); and the 16-bit model saves
(:mod:`zkit.checkpoint.sixteen_bit`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zkit
from zkit.checkpoint.dcp import is_dcp, load_dcp, write_dcp
from zkit.checkpoint.export_hf import looks_like_hf, write_hf_pretrained
from zkit.checkpoint import formats
from zkit.checkpoint.files import META
from zkit.checkpoint.tags import LATEST, tag_directory
from zkit.checkpoint.load import load_checkpoint
from zkit.checkpoint.piece_source import RankFiles
from zkit.checkpoint.save import save_checkpoint
from zkit.checkpoint.sixteen_bit import consolidated_16bit_state_dict, save_16bit_model
from zkit.checkpoint.config import SECTION, CheckpointConfig
from zkit.core.records import CheckpointFormatRecord, ConfigSectionRecord

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.engine import Engine

log = logging.getLogger("zkit")


def _is_zkit(path: Path, tag: str | None) -> bool:
    where = tag_directory(path, tag)
    return where is not None and (where / META).is_file()


def _is_dcp(path: Path, tag: str | None) -> bool:
    return tag is None and is_dcp(path)  # a DCP directory has no tags


def _is_hf(path: Path, tag: str | None) -> bool:
    return tag is None and looks_like_hf(path)


def _load_dcp(engine: "Engine", path: Path, tag: str | None, *, load_optimizer_states: bool,
              load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any]]:
    return load_dcp(engine, path, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states)  # refused: DCP holds no LR schedule


def _load_zkit(engine: "Engine", path: Path, tag: str | None, *, load_optimizer_states: bool,
               load_lr_scheduler_states: bool) -> tuple[str | None, dict[str, Any] | None]:
    if tag is None and not (path / LATEST).is_file():
        # DeepSpeed's answer: a warning and (None, None), so "resume if there is anything to
        # resume" scripts start from scratch on their first run.
        log.warning("no 'latest' file in %s: nothing loaded; pass tag= to load a specific checkpoint", path)
        return None, None
    return load_checkpoint(engine, path, tag, load_optimizer_states=load_optimizer_states,
                           load_lr_scheduler_states=load_lr_scheduler_states)


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    yield ConfigSectionRecord(path=SECTION, schema=CheckpointConfig, description="Checkpoint saving and loading.",
                              default_when_absent=True)


@zkit.hookimpl(trylast=True)
def zkit_register_checkpoint_formats():
    yield CheckpointFormatRecord(
        name="dcp", detect=_is_dcp, load=_load_dcp, export=write_dcp,
        description="PyTorch Distributed Checkpoint (torchtitan, FSDP2): weights and optimizer state by name",
    )
    yield CheckpointFormatRecord(
        name="zkit", detect=_is_zkit, load=_load_zkit, save=save_checkpoint, pieces=RankFiles,
        description="zkit's sharded checkpoint: rank files of pieces, resharded at load",
    )
    yield CheckpointFormatRecord(
        name="hf", detect=_is_hf, export=write_hf_pretrained,
        description="a Hugging Face save_pretrained directory: config.json and safetensors shards",
    )


@zkit.hookimpl(trylast=True)
def zkit_checkpoint_format(engine: "Engine", path: Path, tag: str | None, operation: str) -> CheckpointFormatRecord:
    # the engine refuses, naming the format, an operation the answer lacks (record.operation)
    if operation == "load":
        return formats.for_load(engine.pm, path, tag)
    return formats.named(engine.pm, formats.NATIVE)


@zkit.hookimpl(trylast=True)
def zkit_save_16bit_model(engine: "Engine", path: Path, exclude_frozen_parameters: bool) -> bool:
    return save_16bit_model(engine, path, exclude_frozen_parameters)


@zkit.hookimpl(trylast=True)
def zkit_consolidated_16bit_state_dict(engine: "Engine", exclude_frozen_parameters: bool) -> dict:
    return consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
