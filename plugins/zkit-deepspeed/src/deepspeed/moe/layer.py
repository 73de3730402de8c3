"""``deepspeed.moe.layer``: ``MoE`` is refused (zkit has no expert parallelism)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """Refused when built: zkit has no mixture-of-experts layer (gating, expert parallelism)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE is not supported by zkit: it has no mixture-of-experts layer or expert "
            "parallelism; train the model without MoE layers, or with DeepSpeed"
        )
