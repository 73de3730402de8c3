"""``deepspeed.comm.comm``, where DeepSpeed defines its functions: :mod:`zkit.comm`."""
from zkit.comm import *  # noqa: F401,F403
from zkit.comm import __all__  # noqa: F401
