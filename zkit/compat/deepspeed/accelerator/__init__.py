"""``deepspeed.accelerator``: :mod:`zkit.accelerator`."""
from zkit.accelerator import Accelerator, get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
