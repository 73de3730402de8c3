"""The parts of activation checkpointing (the public API is :mod:`zkit.activations.recompute`).

* :mod:`~zkit.activations.settings`: the resolved settings of one process;
* :mod:`~zkit.activations.storage`: where a checkpoint's saved inputs are kept (host copies,
  a shard per tensor-parallel rank, one contiguous arena);
* :mod:`~zkit.activations.replayed_rng`: extra RNG streams restored for recomputation;
* :mod:`~zkit.activations.tracing`: which regions ``torch.compile`` traces into its graph;
* :mod:`~zkit.activations.policy`: wrapping a model's blocks by policy, and undoing it.
"""
from zkit.activations.recompute import apply
from zkit.activations.policy import CheckpointWrapper, remove, select_blocks
from zkit.activations.settings import CheckpointSettings

__all__ = ["CheckpointSettings", "CheckpointWrapper", "apply", "remove", "select_blocks"]
