"""Built-in plugin: activation checkpointing (recomputation), DeepSpeed's ``activation_checkpointing``
section. Its public names are :mod:`zkit.activations.recompute`'s (``zkit.checkpointing`` and the drop-in's
``deepspeed.checkpointing`` reach that module under DeepSpeed's name), exported here for other
packages and plugins, less ``settings()``, whose name is the submodule's below; the modules are
its parts:

* :mod:`~zkit.activations.settings`: the resolved settings of one process;
* :mod:`~zkit.activations.storage`: where a checkpoint's saved inputs are kept (host copies,
  a shard per tensor-parallel rank, one contiguous arena);
* :mod:`~zkit.activations.replayed_rng`: extra RNG streams restored for recomputation;
* :mod:`~zkit.activations.tracing`: which regions ``torch.compile`` traces into its graph;
* :mod:`~zkit.activations.policy`: wrapping a model's blocks by policy, and undoing it.
"""
from zkit.activations.recompute import (
    CheckpointSettings,
    CheckpointWrapper,
    apply,
    checkpoint,
    configure,
    is_configured,
    profile_report,
    register_rng_tracker,
    remove,
    reset,
    select_blocks,
)

from zkit.activations import recompute as _recompute

__all__ = [name for name in _recompute.__all__ if name != "settings"]
