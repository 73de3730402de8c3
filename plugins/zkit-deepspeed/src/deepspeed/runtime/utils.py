"""``deepspeed.runtime.utils``: the helpers training scripts import from it."""
from __future__ import annotations

import gc
import random
from typing import Any, Callable

import torch

from deepspeed.accelerator.real_accelerator import get_accelerator
from deepspeed.runtime.partition_helpers import call_to_str, partition_balanced, partition_uniform
from zkit.data import RepeatingLoader

__all__ = ["RepeatingLoader", "call_to_str", "move_to_device", "partition_balanced", "partition_uniform",
           "see_memory_usage", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (every device), as DeepSpeed's does."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` (a tensor, or lists, tuples and dicts of them) on ``device``; with
    ``criterion_func``, tensors it accepts are moved in place (their ``.data`` replaced)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if torch.is_tensor(item) else item


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print the accelerator's memory figures on rank 0 when ``force`` (DeepSpeed's switch:
    without it the call does nothing), then reset the peak."""
    if not force:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()
    acc = get_accelerator()
    gib = 1024 ** 3
    print(message)
    print(f"MA {acc.memory_allocated() / gib:.2f} GB Max_MA {acc.max_memory_allocated() / gib:.2f} GB "
          f"CA {acc.memory_reserved() / gib:.2f} GB Max_CA {acc.max_memory_reserved() / gib:.2f} GB")
    acc.reset_peak_memory_stats()


from deepspeed.refused import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # refused names raise FeatureNotProvided (refused.py)
