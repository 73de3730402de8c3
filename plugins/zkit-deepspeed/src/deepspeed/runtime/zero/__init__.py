"""``deepspeed.runtime.zero``: as :mod:`deepspeed.zero`, plus ``unwrap_model_for_generation``."""
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "unwrap_model_for_generation"]

from deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
