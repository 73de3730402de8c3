"""``deepspeed.checkpointing`` (DeepSpeed's activation checkpointing): :mod:`zkit.activations.checkpointing`."""
from zkit.activations.checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
