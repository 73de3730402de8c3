"""Which checkpoint calls ``torch.compile`` can trace into the surrounding graph.

Dynamo traces ``torch.utils.checkpoint`` (non-reentrant) as a higher-order operator: the region
joins the compiled graph, and the compiler decides what to recompute. It cannot trace Python-side
bookkeeping inside that operator (a counter that tells the forward from the recomputation,
``time.perf_counter``), nor the saved-tensor hooks that move stored inputs to the host or split
them over ranks. A region that needs none of these is handed to torch's checkpoint as it is; one
that needs any (:func:`eager_reasons`) runs eagerly, at a graph break of its own, exactly as
without compilation, and the first such region under compilation logs a warning naming why.

Needing eager execution: ``profile`` (timing spans), ``synchronize_checkpoint_boundary`` (device
synchronizations), ``cpu_checkpointing`` and a ``partition_activations`` that really splits
(saved-tensor hooks), and replaying a seeded RNG tracker (zkit-pipeline's tensor-parallel stream,
:mod:`zkit.activations.replayed_rng`), which must be restored for the recomputation only.
"""
from __future__ import annotations

from typing import Any

from zkit.activations.replayed_rng import trackers
from zkit.activations.settings import CheckpointSettings

_EAGER_KEYS = ("profile", "synchronize_checkpoint_boundary", "cpu_checkpointing")


def replays_trackers(preserve_rng_state: bool) -> bool:
    """Whether recomputation must restore some registered tracker's states (one is seeded)."""
    return preserve_rng_state and any(t.states for t in trackers())


def eager_reasons(settings: CheckpointSettings, group: Any, preserve_rng_state: bool) -> list[str]:
    """What makes a checkpoint call with ``settings`` (and a per-call ``group``, which matters only
    with ``partition_activations``) run eagerly; empty where it is just torch's checkpoint."""
    reasons = [f"activation_checkpointing.{key}" for key in _EAGER_KEYS if getattr(settings, key)]
    if settings.partition_activations and (group is not None or settings.splits):
        reasons.append("activation_checkpointing.partition_activations")
    if replays_trackers(preserve_rng_state):
        reasons.append("the replay of a seeded RNG tracker (tensor-parallel dropout)")
    return reasons
