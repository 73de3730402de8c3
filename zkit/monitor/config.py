"""The monitor sections, zkit.monitor's: ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``. Its plugin
registers them (:func:`zkit.monitor.plugin.zkit_config_sections`); :func:`monitor_sections` reads the two
it writes."""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from zkit.core.config.fields import at_least, setting

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.config import ZkitConfig


@attrs.frozen(kw_only=True)
class TensorBoardConfig:
    """Write training scalars as TensorBoard events (needs the ``tensorboard`` extra)."""

    enabled: bool = setting(False, doc="Write TensorBoard events.")
    output_path: str = setting("", doc="Directory for the event files ('' = ./runs).")
    job_name: str = setting("zkit", doc="Sub-directory name of this run.")


@attrs.frozen(kw_only=True)
class CSVMonitorConfig:
    """Write training scalars to CSV files."""

    enabled: bool = setting(False, doc="Write CSV files.")
    output_path: str = setting("", doc="Directory for the files ('' = current directory).")
    job_name: str = setting("zkit", doc="Sub-directory name of this run.")


@attrs.frozen(kw_only=True)
class WandbConfig:
    """Weights & Biases logging."""

    enabled: bool = setting(False, unimplemented=True, doc="Log to Weights & Biases.")
    group: str | None = setting(None, doc="Run group.")
    team: str | None = setting(None, doc="Team (entity).")
    project: str = setting("zkit", doc="Project name.")


@attrs.frozen(kw_only=True)
class CometConfig:
    """Comet ML logging."""

    enabled: bool = setting(False, unimplemented=True, doc="Log to Comet.")
    samples_log_interval: int = setting(100, check=at_least(1), doc="Samples between logs.")
    project: str | None = setting(None, doc="Project name.")
    workspace: str | None = setting(None, doc="Workspace.")
    api_key: str | None = setting(None, doc="API key.")
    experiment_name: str | None = setting(None, doc="Experiment name.")
    experiment_key: str | None = setting(None, doc="Key of an experiment to continue.")
    online: bool | None = setting(None, doc="Log online (true) or offline (false).")
    mode: str | None = setting(None, doc="Comet start mode.")


#: section path -> (schema, what it is), in the order of DeepSpeed's docs
SECTIONS: dict[str, tuple[type, str]] = {
    "tensorboard": (TensorBoardConfig, "TensorBoard monitor."),
    "csv_monitor": (CSVMonitorConfig, "CSV monitor."),
    "wandb": (WandbConfig, "Weights & Biases monitor."),
    "comet": (CometConfig, "Comet monitor."),
}


@attrs.frozen(kw_only=True)
class MonitorSections:
    """The sections :class:`zkit.monitor.writers.Monitor` opens writers for."""

    csv_monitor: CSVMonitorConfig
    tensorboard: TensorBoardConfig


def monitor_sections(config: "ZkitConfig") -> MonitorSections:
    """``config``'s ``csv_monitor`` and ``tensorboard`` sections (their defaults where it holds none)."""
    return MonitorSections(csv_monitor=config.section("csv_monitor") or CSVMonitorConfig(),
                           tensorboard=config.section("tensorboard") or TensorBoardConfig())
