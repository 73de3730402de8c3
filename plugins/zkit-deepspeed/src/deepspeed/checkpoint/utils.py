"""``deepspeed.checkpoint.utils``: what Accelerate's ``get_state_dict`` uses at ZeRO stages 0-2."""
from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts too) replaced by a
    detached copy on ``device``, so that saving it keeps no view of a larger buffer (a view would
    save the whole buffer) and no tensor shares storage with another. Dicts keep their type;
    anything else is returned as it is."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
