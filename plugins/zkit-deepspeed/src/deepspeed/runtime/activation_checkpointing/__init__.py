"""``deepspeed.runtime.activation_checkpointing``."""
from deepspeed import checkpointing

__all__ = ["checkpointing"]
