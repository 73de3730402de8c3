"""ZeRO: the partitioners of zkit's default stages, and what other packages may use of them.

For user code: the stage-3 tools :class:`Init`, :class:`GatheredParameters` and
:class:`ZeroParameter` (with its :class:`ParamStatus`), :func:`building_under_init`, the full values
of a partitioned parameter (``get_full_fp32_param`` ... ``set_full_grad``), the parameters a module
returns (:func:`returned_params`) and ``engine.offload_states``' kinds and devices
(:class:`OffloadStateTypeEnum`, :class:`OffloadDeviceEnum`).

For plugins: the ``zero_optimization`` section (:func:`zero_config`, :class:`ZeroConfig`), the
flat layout's sub-group packing (:func:`pack_aligned`), the side-stream copy queue
(:class:`CopyQueue`, whose copies are :class:`StreamCopy`), a fused host optimizer's copy-out
(:func:`attach_copy_outs`) and the model-state arithmetic ``zkit estimate`` prints
(:func:`model_state_bytes`, :mod:`zkit.zero.model_states`). The other modules are ZeRO's own.
"""
from zkit.zero.config import ZeroConfig, zero_config
from zkit.zero.copy_queue import CopyQueue, StreamCopy
from zkit.zero.flat import pack_aligned
from zkit.zero.full_state import (
    get_full_fp32_param,
    get_full_grad,
    get_full_optimizer_state,
    set_full_fp32_param,
    set_full_grad,
    set_full_optimizer_state,
)
from zkit.zero.init import GatheredParameters, Init, building_under_init
from zkit.zero.memory_store import attach_copy_outs
from zkit.zero.model_states import OFFLOADS, STAGES, StateBytes, model_state_bytes, stage3_plan, stage3_units
from zkit.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum
from zkit.zero.returned import returned_params
from zkit.zero.sharded_params import ParamStatus, ZeroParameter

__all__ = [
    "OFFLOADS",
    "STAGES",
    "CopyQueue",
    "GatheredParameters",
    "Init",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ParamStatus",
    "StateBytes",
    "StreamCopy",
    "ZeroConfig",
    "ZeroParameter",
    "attach_copy_outs",
    "building_under_init",
    "get_full_fp32_param",
    "get_full_grad",
    "get_full_optimizer_state",
    "model_state_bytes",
    "pack_aligned",
    "returned_params",
    "set_full_fp32_param",
    "set_full_grad",
    "set_full_optimizer_state",
    "stage3_plan",
    "stage3_units",
    "zero_config",
]
