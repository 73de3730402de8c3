"""``deepspeed.checkpoint``: the helpers that Accelerate and transformers import from it.

Reading checkpoints that DeepSpeed wrote is :mod:`zkit.checkpoint.deepspeed`'s job (through
``engine.load_checkpoint`` and ``zkit consolidate``); this package only carries DeepSpeed's names.
"""
from zkit.compat.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
