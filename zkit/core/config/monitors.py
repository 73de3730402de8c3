"""Monitor and profiler sections."""
import attrs

from zkit.core.config.fields import at_least, setting


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


@attrs.frozen(kw_only=True)
class FlopsProfilerConfig:
    """Count FLOPs and time per module for one step."""

    enabled: bool = setting(False, unimplemented=True, doc="Profile one step.")
    recompute_fwd_factor: float = setting(
        0.0, check=at_least(0), doc="Extra forward passes from activation recomputation."
    )
    profile_step: int = setting(1, check=at_least(1), doc="Step to profile.")
    module_depth: int = setting(-1, doc="Depth of the module tree to print (-1: all).")
    top_modules: int = setting(1, check=at_least(1), doc="Modules listed per depth.")
    detailed: bool = setting(True, doc="Print the per-module breakdown.")
    output_file: str | None = setting(None, doc="Write the report here (null: stdout).")
