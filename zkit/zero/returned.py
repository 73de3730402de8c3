"""The partitioned parameters a module's forward returns (DeepSpeed's "dangling" parameters).

A forward may return one of its own parameters for its caller to use (a bias added later, say).
Stage 3 must not release that parameter's unit when the module's forward ends: the caller would
find it released. Outputs are searched as DeepSpeed does: a tensor, a list or tuple, a dict's
values, or an object's attributes, one level deep.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch


def returned_params(output: Any) -> Iterator[torch.nn.Parameter]:
    """The partitioned parameters (they have a ``ds_status``) among ``output``'s items."""
    if output is None:
        return
    if torch.is_tensor(output):
        items: Any = [output]
    elif isinstance(output, (list, tuple)):
        items = output
    elif isinstance(output, dict):
        items = output.values()
    else:
        items = [v for k, v in getattr(output, "__dict__", {}).items() if not k.startswith("__")]
    for item in items:
        if isinstance(item, torch.nn.Parameter) and hasattr(item, "_zkit_unit"):
            yield item
