"""Config sections of zkit-offload, with DeepSpeed's keys and defaults (DeepSpeed 0.19).

* ``zero_optimization.offload_optimizer``: where fp32 master weights, their gradients and the
  optimizer state live (``device``: ``none``, ``cpu`` or ``nvme``).
* ``zero_optimization.offload_param``: where stage-3 parameter shards live.
* ``aio``: the NVMe swapper's I/O settings.

Keys DeepSpeed has for its libaio engine that have no counterpart in a thread-pool swapper
(``single_submit``, ``overlap_events``) and pipeline switches that zkit always has on
(``pipeline_read``, ``pipeline_write``, ``fast_init``) are accepted so DeepSpeed configs load, and
documented in docs/plugins/offload.md; ``use_gds=true`` and ``ratio<1`` are refused when a run
is configured, with the reason.
"""
from __future__ import annotations

import difflib
from typing import Any, ClassVar, Mapping

import attrs
from attrs import validators as v

DEVICES = ("none", "cpu", "nvme")


def _device(value: Any) -> str:
    return str(value).lower()


def _nvme_needs_path(instance: Any, _attribute: Any, value: Any) -> None:
    if instance.device == "nvme" and not instance.nvme_path:
        raise ValueError(f"{instance.SECTION}: device 'nvme' needs nvme_path (a directory on the fast disk)")


class _FromDict:
    SECTION = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None):
        """Build from a config dict; an unknown key is an error naming the closest valid one."""
        data = dict(data or {})
        for old, new in getattr(cls, "key_aliases", {}).items():
            if old in data:
                if new in data:
                    raise ValueError(f"{cls.SECTION}: '{old}' and '{new}' are both given; '{old}' is the old name "
                                     f"of '{new}': keep only '{new}'")
                data[new] = data.pop(old)
        valid = [a.name for a in attrs.fields(cls)]
        close_to = valid + list(getattr(cls, "key_aliases", {}))
        for key in data:
            if key not in valid:
                close = difflib.get_close_matches(key, close_to, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown key {key!r} in {cls.SECTION}{hint} Valid keys: {', '.join(valid)}")
        return cls(**data)


_nonneg_int = [v.instance_of(int), v.ge(0)]


@attrs.frozen(kw_only=True)
class OffloadOptimizerConfig(_FromDict):
    """``zero_optimization.offload_optimizer``."""

    SECTION = "zero_optimization.offload_optimizer"

    device: str = attrs.field(default="none", converter=_device, validator=v.in_(DEVICES))
    nvme_path: str | None = attrs.field(default=None, validator=[v.optional(v.instance_of(str)), _nvme_needs_path])
    buffer_count: int = attrs.field(default=4, validator=_nonneg_int)
    pin_memory: bool = attrs.field(default=True, validator=v.instance_of(bool))
    pipeline_read: bool = attrs.field(default=False, validator=v.instance_of(bool), metadata={
        "hint": "zkit-offload always reads the next sub-group ahead while one steps"})
    pipeline_write: bool = attrs.field(default=False, validator=v.instance_of(bool), metadata={
        "hint": "zkit-offload always writes a stepped sub-group back while the next one steps"})
    fast_init: bool = attrs.field(default=False, validator=v.instance_of(bool), metadata={
        "hint": "zkit-offload writes the initial swap files sub-group by sub-group, with no extra pass"})
    ratio: float = attrs.field(default=1.0, converter=float, validator=[v.ge(0.0), v.le(1.0)])
    #: zkit's own key: step each sub-group (``nvme``) or unit (``cpu``) during the backward that
    #: ends a batch, as soon as its gradients are complete (stages 2-3; no clipping, no fp16)
    step_in_backward: bool = attrs.field(default=False, validator=v.instance_of(bool))


@attrs.frozen(kw_only=True)
class OffloadParamConfig(_FromDict):
    """``zero_optimization.offload_param`` (stage 3)."""

    SECTION = "zero_optimization.offload_param"

    device: str = attrs.field(default="none", converter=_device, validator=v.in_(DEVICES))
    nvme_path: str | None = attrs.field(default=None, validator=[v.optional(v.instance_of(str)), _nvme_needs_path])
    buffer_count: int = attrs.field(default=5, validator=_nonneg_int)
    buffer_size: int = attrs.field(default=100_000_000, converter=int, validator=v.ge(0))
    max_in_cpu: int = attrs.field(default=1_000_000_000, converter=int, validator=v.ge(0))
    pin_memory: bool = attrs.field(default=True, validator=v.instance_of(bool))


@attrs.frozen(kw_only=True)
class AioConfig(_FromDict):
    """``aio``: NVMe swapper I/O. ``block_size`` bytes per request; ``queue_depth`` x
    ``intra_op_parallelism`` requests in flight (the I/O thread count)."""

    SECTION = "aio"
    #: DeepSpeed's older name for ``intra_op_parallelism`` (Lightning's default config still sets it)
    key_aliases: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: int = attrs.field(default=1_048_576, validator=[v.instance_of(int), v.gt(0)])
    queue_depth: int = attrs.field(default=8, validator=[v.instance_of(int), v.gt(0)])
    intra_op_parallelism: int = attrs.field(default=1, validator=[v.instance_of(int), v.gt(0)])
    single_submit: bool = attrs.field(default=False, validator=v.instance_of(bool), metadata={
        "hint": "zkit-offload's swapper is a thread pool, not libaio: there are no submissions to batch"})
    overlap_events: bool = attrs.field(default=True, validator=v.instance_of(bool), metadata={
        "hint": "zkit-offload's swapper is a thread pool, not libaio: its requests always overlap"})
    use_gds: bool = attrs.field(default=False, validator=v.instance_of(bool))

    @property
    def io_threads(self) -> int:
        return self.queue_depth * self.intra_op_parallelism


def check_supported(optimizer: OffloadOptimizerConfig, aio: AioConfig) -> None:
    """Refuse settings this release cannot honour, saying why (never ignore them silently)."""
    if aio.use_gds:
        raise ValueError("aio.use_gds=true: GPUDirect Storage is not supported by zkit-offload; "
                         "set it to false (NVMe swaps go through pinned host buffers)")
    if optimizer.device != "none" and optimizer.ratio != 1.0:
        raise ValueError(f"zero_optimization.offload_optimizer.ratio={optimizer.ratio}: partial optimizer "
                         "offload is not supported; use 1.0 (offload all) or device 'none'")


def check_step_in_backward(optimizer: OffloadOptimizerConfig, stage: int | None, gradient_clipping: float,
                           fp16: bool) -> None:
    """Refuse what ``step_in_backward`` cannot honour: a sub-group steps before the last gradient
    of the batch exists, so nothing may need all of them first."""
    if not optimizer.step_in_backward:
        return
    key = "zero_optimization.offload_optimizer.step_in_backward"
    if optimizer.device == "none":
        raise ValueError(f"{key} needs device 'cpu' or 'nvme' (got {optimizer.device!r}): it steps the offloaded "
                         "optimizer during backward")
    if stage is not None and stage < 2:
        raise ValueError(f"{key} needs ZeRO stage 2 or 3 (the stages whose gradients reach the offloaded master "
                         f"unit by unit); this config has zero_optimization.stage {stage}")
    steps = "steps each unit" if optimizer.device == "cpu" else "steps sub-groups"
    if gradient_clipping > 0:
        raise ValueError(f"{key} cannot run with gradient_clipping {gradient_clipping}: clipping scales every "
                         "gradient by the global norm, which is known only after the last gradient, and "
                         f"step_in_backward {steps} before that. Drop one of the two")
    if fp16:
        raise ValueError(f"{key} cannot run with fp16.enabled: the loss scaler skips a step whose gradients "
                         f"overflowed, which is known only after the last gradient, and step_in_backward {steps} "
                         "before that. Use bf16, or drop step_in_backward")
