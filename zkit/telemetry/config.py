"""``flops_profiler``, zkit.telemetry's section (registered by :mod:`zkit.telemetry.plugin`)."""
import attrs

from zkit.core.config.fields import at_least, setting


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
