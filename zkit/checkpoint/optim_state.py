"""Where loaded optimizer state goes: where torch's ``Optimizer.load_state_dict`` would put it.

zkit's loaders assign each piece's state (``optimizer.state[param] = ...``) rather than going
through ``load_state_dict``, so they place every value themselves: a tensor shaped like the
parameter goes to the parameter's device in its shape; the step count goes to the parameter's
device as fp32 where the parameter's group steps with a fused or capturable kernel, which reads it
there (torch's fused CUDA Adam refuses a step count left on the CPU); anything else stays as saved.
"""
from __future__ import annotations

from typing import Any

import torch


class StatePlacer:
    """Places loaded state values for the parameters of one optimizer (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group_of: dict[int, dict[str, Any]] | None = None

    def _group(self, param: torch.Tensor) -> dict[str, Any]:
        if self._group_of is None:  # once per load: a model has many pieces
            self._group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        return self._group_of.get(id(param), {})

    def place(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (one parameter's, as loaded) with its values where the optimizer reads them."""
        group = self._group(param)
        kernel_reads_step_on_device = bool(group.get("fused") or group.get("capturable"))
        placed = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                value = value.to(param.device).view(param.shape)
            elif torch.is_tensor(value) and key == "step" and kernel_reads_step_on_device:
                value = value.to(device=param.device, dtype=torch.float32)
            placed[key] = value
        return placed
