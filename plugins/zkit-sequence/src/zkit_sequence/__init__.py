"""Ulysses sequence parallelism for zkit, and ALST's tiled pieces for long sequences.

::

    model = LlamaLM(LlamaConfig(..., attention="ulysses"))       # or any model built with
    engine, *_ = zkit.initialize(model=model, config={            # build_attention("ulysses", inner=...)
        "sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1, ...})
    for input_ids, labels, position_ids in SequenceShards(loader, sequence_communicator(engine)):
        loss = engine(input_ids, labels, position_ids)            # each rank: its slice of the sequence
        engine.backward(loss)
        engine.step()

See ``docs/plugins/sequence.md``.
"""

__version__ = "0.1.0"

from typing import Any

from zkit_sequence.attention import UlyssesAttention
from zkit_sequence.binding import SequenceParallel, bind_model
from zkit_sequence.data import SequenceShards, shard, with_positions
from zkit_sequence.groups import GROUPS, SequenceGroups
from zkit_sequence.loss import SequenceParallelCrossEntropy, mean_over_sequence, sequence_cross_entropy
from zkit_sequence.tiling import TiledMLP, tiled_logits_loss_sum


def sequence_groups(engine: Any) -> SequenceGroups | None:
    """The engine's sequence-parallel groups (``None`` when ``sequence_parallel_size`` is 1)."""
    return engine.stash.get(GROUPS, None)


def sequence_communicator(engine: Any) -> Any:
    """The communicator of the engine's sequence-parallel ranks (``None`` without sequence parallelism)."""
    groups = sequence_groups(engine)
    return None if groups is None else groups.comm


__all__ = [
    "SequenceGroups", "SequenceParallel", "SequenceParallelCrossEntropy", "SequenceShards", "TiledMLP",
    "UlyssesAttention", "bind_model", "mean_over_sequence", "sequence_communicator", "sequence_cross_entropy",
    "sequence_groups", "shard", "tiled_logits_loss_sum", "with_positions",
]
