"""``deepspeed.comm``: :mod:`zkit.comm` (``torch.distributed``'s functions under DeepSpeed's names)."""
from zkit.comm import *  # noqa: F401,F403 - the module's whole public surface
from zkit.comm import __all__  # noqa: F401
