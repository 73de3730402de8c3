"""``deepspeed.runtime.activation_checkpointing.checkpointing``: as ``deepspeed.checkpointing``."""
from deepspeed.checkpointing import *  # noqa: F401,F403
from deepspeed.checkpointing import __all__  # noqa: F401
