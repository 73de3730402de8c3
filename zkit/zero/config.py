"""``zero_optimization``: DeepSpeed's ZeRO keys, names and defaults unchanged. The section is zkit.zero's:
its plugin registers it (:func:`zkit.zero.plugin.zkit_config_sections`) and chooses the partitioner record
its ``stage`` names. Read it with :func:`zero_config`.

The offload sub-sections belong to the ``zkit-offload`` distribution (see
:mod:`zkit.distributions` names it for when it is not installed); their fields here hold whatever that plugin's schema structured,
or ``None`` for no offload.
"""
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from zkit.core.config.errors import ConfigError
from zkit.core.config.fields import at_least, between, one_of, setting

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.config import ZkitConfig

#: the section's dotted path in a config
SECTION = "zero_optimization"

_NO_BUCKETS = (
    "zkit reduces each unit (reduce_bucket_size) with one collective; "
    "this switch has no effect"
)


def _hpz_requested(value: int) -> bool:
    return value > 1


def _mics_requested(value: int) -> bool:
    return value != -1


def _params_offload_device(section: Any) -> str:
    """Where an ``offload_param`` section (zkit-offload's schema, or a plain dict) puts the
    parameter shards: ``"none"``, ``"cpu"`` or ``"nvme"``."""
    if section is None:
        return "none"
    device = section.get("device") if isinstance(section, dict) else getattr(section, "device", None)
    return str(getattr(device, "value", device) or "none").lower()


@attrs.frozen(kw_only=True)
class ZeroConfig:
    """Sets the ZeRO stage and its buffers. Stage 0 is plain data parallelism; 1 partitions
    optimizer states, 2 also gradients, 3 also parameters."""

    #: other names DeepSpeed reads -> zkit's keys: a deprecated name, and the field names of
    #: DeepSpeed's pydantic model, which accepts ``prefetch_bucket_size`` as well as its alias
    #: ``stage3_prefetch_bucket_size`` (zkit's key)
    key_aliases: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        **{name: f"stage3_{name}" for name in (
            "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
            "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
            "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
        )},
    }

    stage: int = setting(0, check=between(0, 3), doc="ZeRO stage: 0 (off), 1, 2 or 3.")
    contiguous_gradients: bool = setting(
        True,
        doc="Copy gradients into a contiguous buffer as they are produced.",
        hint="zkit always reduces gradients into flat contiguous buckets",
    )
    reduce_scatter: bool = setting(
        True,
        doc="Average gradients with reduce-scatter (true) or all-reduce (false).",
        hint="zkit's stages 1-3 always reduce-scatter into each rank's shard; an all-reduce gives the "
        "same averages with twice the traffic",
    )
    reduce_bucket_size: int = setting(
        500_000_000, check=at_least(0), doc="Elements reduced at a time (accepts 5e8)."
    )
    use_multi_rank_bucket_allreduce: bool = setting(
        True,
        doc="Combine the reduce buckets of several ranks into one all-reduce.",
        hint=_NO_BUCKETS,
    )
    allgather_partitions: bool = setting(
        True,
        doc="Gather updated parameters with all-gather (true) or broadcasts (false).",
        hint="zkit all-gathers updated shards in place; broadcasts would give the same parameters",
    )
    allgather_bucket_size: int = setting(
        500_000_000,
        check=at_least(0),
        doc="Elements all-gathered at a time (accepts 5e8).",
        hint="zkit all-gathers each unit (sized by reduce_bucket_size) in place into the parameters' own "
        "flat buffer, so there is no gather buffer for this to size",
    )
    overlap_comm: bool = setting(
        attrs.Factory(lambda self: self.stage == 3, takes_self=True),
        default_doc="true at stage 3, else false",
        doc="Overlap gradient reduction with the backward pass.",
    )
    overlap_param_gather: bool = setting(
        False,
        doc="Stages 1-2: all-gather the updated parameters in the background after the optimizer "
        "step; the next forward waits for each parameter just before its first use. Code that reads "
        "parameters between step() and the next forward calls engine.wait_for_parameters() first. "
        "At stage 0, stage 3 or with one data-parallel replica there is nothing to overlap: "
        "initialize warns that it has no effect.",
    )
    load_from_fp32_weights: bool = setting(
        True,
        unimplemented=True,
        doc="Initialize fp32 master weights from the checkpoint's fp32 copies (false: from its 16-bit weights).",
    )
    elastic_checkpoint: bool = setting(
        False,
        doc="Legacy elastic checkpoint flag.",
        hint="zkit checkpoints are always reshardable to another world size",
    )
    offload_param: Any = setting(
        None, doc="Offload parameters to CPU or NVMe (stage 3). Provided by zkit-offload.", plugin_slot=True
    )
    offload_optimizer: Any = setting(
        None, doc="Offload optimizer states and step to CPU or NVMe. Provided by zkit-offload.", plugin_slot=True
    )
    zenflow: dict | None = setting(
        None, unimplemented=lambda v: v is not None, doc="ZenFlow stall-free offloading."
    )
    sub_group_size: int = setting(
        1_000_000_000, check=at_least(0), doc="Elements per optimizer-step tile (offload)."
    )
    stage3_prefetch_bucket_size: int = setting(
        50_000_000, check=at_least(0), doc="Parameter elements fetched ahead of use (stage 3)."
    )
    stage3_param_persistence_threshold: int = setting(
        100_000, check=at_least(0), doc="Parameters smaller than this stay unpartitioned."
    )
    stage3_gather_unit: str = setting(
        attrs.Factory(lambda self: "module" if _params_offload_device(self.offload_param) == "nvme" else "block",
                      takes_self=True),
        default_doc='"block"; "module" with offload_param on nvme',
        check=one_of(("block", "module")),
        doc="What stage 3 gathers and releases as one unit, with one collective: \"block\" (FSDP2's "
        "per-block wrap), each block of the model (the children of a ModuleList or Sequential that holds "
        "two or more of their class, such as a transformer's layers) with every parameter under it, and the "
        "root with the parameters outside any block; \"module\" (DeepSpeed's units), each module's own "
        "parameters. zkit's key. Per block, a parameter within stage3_param_persistence_threshold stays "
        "gathered, in a unit of its own per block. With offload_param on nvme the default is \"module\": the "
        "shards are read from disk into buffers of offload_param.buffer_size, sized per module as in DeepSpeed; "
        "with offload_param on cpu a gather is one copy to the device and one collective per block.",
    )
    stage3_model_persistence_threshold: int = setting(
        sys.maxsize,
        check=at_least(0),
        default_doc="sys.maxsize",
        doc="Upper bound on the total elements kept unpartitioned.",
    )
    stage3_max_live_parameters: int = setting(
        1_000_000_000, check=at_least(0), doc="Parameter elements resident before releasing."
    )
    stage3_max_reuse_distance: int = setting(
        1_000_000_000,
        check=at_least(0),
        doc="Do not release a parameter reused within this many elements (stage 3).",
    )
    stage3_gather_16bit_weights_on_model_save: bool = setting(
        False,
        doc="Gather full 16-bit weights when saving the model (old name: "
        "stage3_gather_fp16_weights_on_model_save).",
    )
    stage3_module_granularity_threshold: int = setting(
        0,
        check=at_least(0),
        doc="Fetch fine-grained modules as one unit.",
        hint="zkit fetches parameters in buckets, not per module",
    )
    stage3_use_all_reduce_for_fetch_params: bool = setting(
        False,
        doc="Fetch parameters with all-reduce instead of all-gather.",
        hint="zkit fetches with all-gather into a flat buffer, which needs no host-side concat",
    )
    stage3_allgather_sequential: bool = setting(
        False,
        doc="All-gather parameters one by one instead of bucketed.",
        hint="zkit gathers whole buckets in place, with no copy into a staging buffer",
    )
    stage3_partition_stream_chunk_size: int = setting(
        0,
        check=at_least(0),
        doc="Partition huge parameters by streaming chunks of this size at initialization.",
        hint="zkit partitions each parameter in place from its flat buffer",
    )
    ignore_unused_parameters: bool = setting(
        True,
        unimplemented=True,
        doc="Tolerate parameters that received no gradient (they get a zero gradient); false: an error.",
    )
    legacy_stage1: bool = setting(
        False, unimplemented=True, doc="DeepSpeed's old stage-1 implementation."
    )
    round_robin_gradients: bool = setting(
        False,
        doc="Spread gradient copies to CPU over ranks (offload, stages 1-2).",
        hint="zkit's offload copies each rank's own partition only",
    )
    zero_hpz_partition_size: int = setting(
        1,
        check=at_least(0),
        unimplemented=_hpz_requested,
        doc="ZeRO++ hierarchical partitioning: ranks in the secondary group (>1 enables).",
    )
    zero_quantized_weights: bool = setting(
        False, unimplemented=True, doc="ZeRO++ quantized weight all-gather."
    )
    zero_quantized_nontrainable_weights: bool = setting(
        False, unimplemented=True, doc="Keep non-trainable weights quantized."
    )
    zero_quantized_gradients: bool = setting(
        False, unimplemented=True, doc="ZeRO++ quantized gradient reduction."
    )
    zeropp_loco_param: dict | None = setting(
        None, unimplemented=lambda v: v is not None, doc="LoCo-ZeRO++ error feedback."
    )
    mics_shard_size: int = setting(
        -1, unimplemented=_mics_requested, doc="MiCS shard group size (-1: off)."
    )
    mics_hierarchical_params_gather: bool = setting(
        False, unimplemented=True, doc="MiCS hierarchical all-gather."
    )
    memory_efficient_linear: bool = setting(
        True,
        doc="Use a memory-saving linear layer under stage 3.",
        hint="zkit does not replace torch.nn.functional.linear",
    )
    pipeline_loading_checkpoint: bool = setting(
        False,
        doc="Load stage-3 checkpoints in pipeline mode.",
        hint="zkit checkpoints load the same way with or without pipelines",
    )
    override_module_apply: bool = setting(
        True,
        doc="Patch nn.Module.apply to gather stage-3 parameters.",
        hint="zkit gathers parameters through module hooks only",
    )
    log_trace_cache_warnings: bool = setting(
        False,
        doc="Log stage-3 trace-cache warnings.",
        hint="zkit has no trace cache: prefetch follows the recorded module order",
    )
    enable_sanity_checks: bool = setting(
        False,
        doc="Extra internal consistency checks.",
        hint="zkit's consistency checks are always on",
    )
    save_muon_momentum_buffer_in_memory: bool = setting(
        False,
        doc="Keep Muon momentum in memory under NVMe offload.",
        hint="zkit does not ship a Muon optimizer",
    )
    leaf_module: dict | None = setting(
        None,
        unimplemented=lambda v: bool(v),
        doc="Modules to treat as stage-3 leaves (fetched as a whole).",
    )

    @staticmethod
    def rewrite_legacy(data: dict[str, Any], path: str) -> dict[str, Any]:
        """DeepSpeed's deprecated booleans ``cpu_offload`` / ``cpu_offload_param`` (with
        ``cpu_offload_use_pin_memory``) become ``offload_optimizer`` / ``offload_param``."""
        legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
        if not any(k in data for k in (*legacy, "cpu_offload_use_pin_memory")):
            return data
        data = dict(data)
        pin = data.pop("cpu_offload_use_pin_memory", None)
        if pin is not None and type(pin) is not bool:
            raise ConfigError.at(
                f"{path}.cpu_offload_use_pin_memory", f"must be a bool (true or false), got {pin!r}"
            )
        converted = False
        for old, new in legacy.items():
            if old not in data:
                continue
            value = data.pop(old)
            if value is None:
                continue
            if type(value) is not bool:
                raise ConfigError.at(
                    f"{path}.{old}", f"must be a bool (true or false), got {value!r}"
                )
            if not value:
                continue
            if data.get(new) is not None:
                raise ConfigError(
                    f"config keys '{path}.{old}' and '{path}.{new}' are both given; "
                    f"'{old}' is the deprecated form of '{new}': keep only '{new}'"
                )
            data[new] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
            converted = True
        if pin and not converted:
            raise ConfigError.at(
                f"{path}.cpu_offload_use_pin_memory",
                "has an effect only with cpu_offload or cpu_offload_param set to true; "
                "use 'pin_memory' inside offload_optimizer / offload_param instead",
            )
        return data


def zero_config(config: "ZkitConfig") -> ZeroConfig:
    """``config``'s ``zero_optimization`` section; its defaults when the config holds none (one
    loaded without zkit.zero's section record, e.g. with the ``zkit.partitioners`` plugin blocked)."""
    section = config.section(SECTION)
    return ZeroConfig() if section is None else section
