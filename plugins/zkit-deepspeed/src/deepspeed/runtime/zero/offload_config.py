"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums and the two offload
sections as classes (0.19.8's fields and defaults). The enums are zkit's own
(:mod:`zkit.zero.offload_states`), so ``engine.offload_states(device=OffloadDeviceEnum.cpu,
include=[OffloadStateTypeEnum.optim_states])`` takes them as they are. The config classes validate
as DeepSpeed's do (unknown keys, bounds, the device names) and are what code builds by hand;
``initialize`` reads the same keys from the config dict (zkit-offload's schema)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

from zkit.zero import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


def _device(value: Any) -> str:
    """DeepSpeed keeps the enum's value (``use_enum_values``): ``"cpu"``, which equals ``OffloadDeviceEnum.cpu``."""
    try:
        return OffloadDeviceEnum(value).value
    except ValueError:
        raise ValueError(f"device must be one of none, cpu, nvme; got {value!r}") from None


def _path(value: Any) -> Path | None:
    return None if value is None else Path(value)


_count = [v.instance_of(int), v.ge(0)]


@attrs.define(kw_only=True)
class DeepSpeedZeroOffloadParamConfig:
    """``zero_optimization.offload_param``: where stage-3 parameters live."""

    device: str = attrs.field(default="none", converter=_device)
    nvme_path: Path | None = attrs.field(default=None, converter=_path)
    buffer_count: int = attrs.field(default=5, validator=_count)
    buffer_size: int = attrs.field(default=100_000_000, converter=int, validator=v.ge(0))
    max_in_cpu: int = attrs.field(default=1_000_000_000, converter=int, validator=v.ge(0))
    pin_memory: bool = attrs.field(default=True, validator=v.instance_of(bool))


@attrs.define(kw_only=True)
class DeepSpeedZeroOffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the fp32 master and optimizer state live."""

    device: str = attrs.field(default="none", converter=_device)
    nvme_path: Path | None = attrs.field(default=None, converter=_path)
    buffer_count: int = attrs.field(default=4, validator=_count)
    pin_memory: bool = attrs.field(default=True, validator=v.instance_of(bool))
    pipeline_read: bool = attrs.field(default=False, validator=v.instance_of(bool))
    pipeline_write: bool = attrs.field(default=False, validator=v.instance_of(bool))
    fast_init: bool = attrs.field(default=False, validator=v.instance_of(bool))
    ratio: float = attrs.field(default=1.0, converter=float, validator=[v.ge(0.0), v.le(1.0)])
    super_offload: bool = attrs.field(default=False, validator=v.instance_of(bool))
    cpuadam_cores_perc: float = attrs.field(default=0.8, converter=float, validator=[v.ge(0.0), v.le(1.0)])

    @property
    def pipeline(self) -> bool:
        """Whether either pipelined NVMe transfer is on (DeepSpeed's derived field)."""
        return self.pipeline_read or self.pipeline_write
