"""``deepspeed.runtime.zero``: as :mod:`deepspeed.zero`."""
from zkit.compat.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
