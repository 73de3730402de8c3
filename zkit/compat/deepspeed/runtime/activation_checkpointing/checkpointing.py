"""``deepspeed.runtime.activation_checkpointing.checkpointing``: as ``deepspeed.checkpointing``."""
from zkit.compat.deepspeed.checkpointing import *  # noqa: F401,F403
from zkit.compat.deepspeed.checkpointing import __all__  # noqa: F401
