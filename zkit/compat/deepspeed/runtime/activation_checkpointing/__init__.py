"""``deepspeed.runtime.activation_checkpointing``."""
from zkit.compat.deepspeed import checkpointing

__all__ = ["checkpointing"]
