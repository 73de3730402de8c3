"""``deepspeed.OnDevice``: build a model's tensors on a given device (``"meta"`` to allocate nothing)
and, optionally, in a given floating dtype."""
from __future__ import annotations

from typing import Any

import torch


class OnDevice:
    """``with OnDevice(dtype=torch.half, device="meta"): model = Model()``. ``enabled=False`` makes
    it do nothing. Tensors created without an explicit device go to ``device``; floating tensors
    created without an explicit dtype get ``dtype`` (None keeps torch's default)."""

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice: dtype must be a floating dtype, got {dtype}")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._previous_dtype: torch.dtype | None = None

    def __enter__(self) -> "OnDevice":
        if self.enabled:
            self.device.__enter__()
            if self.dtype is not None:
                self._previous_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if self._previous_dtype is not None:
                torch.set_default_dtype(self._previous_dtype)
                self._previous_dtype = None
            self.device.__exit__(*exc)
