"""``deepspeed.comm``: :mod:`deepspeed.comm.comm` (``torch.distributed``'s functions under DeepSpeed's names)."""
from deepspeed.comm.comm import *  # noqa: F401,F403 - the module's whole public surface
from deepspeed.comm.comm import __all__  # noqa: F401

from deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
