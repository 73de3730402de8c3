"""``deepspeed.accelerator``: :mod:`deepspeed.accelerator.real_accelerator` (the device this process trains on)."""
from deepspeed.accelerator.real_accelerator import Accelerator, get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
