"""``deepspeed.comm``: :mod:`zkit.comm` (``torch.distributed``'s functions under DeepSpeed's names)."""
from zkit.comm import *  # noqa: F401,F403 - the module's whole public surface
from zkit.comm import __all__  # noqa: F401

from zkit.compat.deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
