"""``deepspeed.checkpoint``: the helpers that Accelerate and transformers import from it.

Reading checkpoints that DeepSpeed wrote is :mod:`zkit_deepspeed.checkpoint`'s job (the
``"deepspeed"`` checkpoint format, which ``engine.load_checkpoint`` and ``zkit consolidate`` use);
this package only carries DeepSpeed's names.
"""
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
