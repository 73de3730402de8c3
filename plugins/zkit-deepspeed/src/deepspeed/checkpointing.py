"""``deepspeed.checkpointing`` (DeepSpeed's activation checkpointing): :mod:`zkit.checkpointing`."""
from zkit.checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
