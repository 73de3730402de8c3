"""``checkpoint``, zkit.checkpoint's section: its plugin registers it (:mod:`zkit.checkpoint.plugin`);
:func:`checkpoint_config` reads it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from zkit.core.config.fields import one_of, setting, upper

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.config import ZkitConfig

SECTION = "checkpoint"


@attrs.frozen(kw_only=True)
class ParallelWriteConfig:
    """Which ranks write checkpoint files."""

    pipeline_stage: bool = setting(
        False,
        doc="Each pipeline stage writes its own files.",
        hint="every zkit rank already writes its own file, and each pipeline part its own directory",
    )


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """Saving and loading checkpoints."""

    tag_validation: str = setting(
        "WARN",
        check=one_of(("WARN", "IGNORE", "FAIL")),
        edge=upper,
        doc="What to do when ranks save with different tags: Warn, Ignore or Fail.",
    )
    load_universal: bool = setting(
        False,
        doc="Load a DeepSpeed universal checkpoint.",
        hint="zkit checkpoints are always world-size independent, so there is nothing to convert",
    )
    use_node_local_storage: bool = setting(
        False,
        unimplemented=True,
        doc="Every node writes its ranks' files to local storage (zkit needs one shared directory: a "
        "rank reads back whichever files hold the ranges it owns, at any world size).",
    )
    parallel_write: ParallelWriteConfig = setting(
        attrs.Factory(ParallelWriteConfig), default_doc="{}", doc="Which ranks write files."
    )


def checkpoint_config(config: "ZkitConfig") -> CheckpointConfig:
    """``config``'s ``checkpoint`` section (its defaults where it holds none)."""
    return config.section(SECTION) or CheckpointConfig()
