"""``deepspeed.checkpointing`` (DeepSpeed's activation checkpointing): :mod:`zkit.activations.recompute`."""
from zkit.activations import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
