"""Built-in plugin: zkit's optimizers (torch's Adam/AdamW/SGD, LAMB, a client's ``optimizer=``),
registered by name by :mod:`zkit.optim.plugin`.

Public names: :class:`Lamb`; :func:`adam_settings`, the checked ``Adam``/``AdamW`` settings of a
config that every implementation of those types reads (zkit-offload's and zkit-cuda-numba's too);
and :class:`FusedStepOptimizer`, the protocol of an optimizer whose step fuses the partitioner's
passes over the gradients (:mod:`zkit.optim.fused_step`)."""
from __future__ import annotations

from zkit.optim.fused_step import FusedStepOptimizer
from zkit.optim.lamb import Lamb
from zkit.optim.plugin import adam_settings

__all__ = ["FusedStepOptimizer", "Lamb", "adam_settings"]
