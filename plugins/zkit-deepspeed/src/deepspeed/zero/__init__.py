"""``deepspeed.zero``: ZeRO-3 construction and parameter access (:mod:`zkit.zero`)."""
from deepspeed.runtime.zero import *  # noqa: F401,F403
from deepspeed.runtime.zero import __all__  # noqa: F401

from deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
