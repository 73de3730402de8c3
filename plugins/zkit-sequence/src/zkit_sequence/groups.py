"""The sequence-parallel layout of a world of ``data x sequence`` ranks, DeepSpeed's: ranks
``r * P .. r * P + P - 1`` split one sequence (a sequence group of ``P`` consecutive ranks, the
fastest links), and the ranks with the same place in their sequence groups form a data-parallel
group. ZeRO shards over all ``data x sequence`` ranks: one shard per rank, as DeepSpeed's
``seq_data_parallel_group``."""
from __future__ import annotations

from typing import Any

import attrs
import torch.distributed as dist

from zkit.core.stash import StashKey


@attrs.frozen
class SequenceGroups:
    """This rank's groups: ``sequence`` (``size`` ranks, its communicator ``comm``) and ``data``
    (the ranks holding the same slice of other samples)."""

    size: int
    sequence: Any
    comm: Any
    data: Any

    @property
    def rank(self) -> int:
        """This rank's place in its sequence group (which slice of each sequence it holds)."""
        return self.comm.rank


#: an engine's sequence-parallel groups, set when it is built with ``sequence_parallel_size`` > 1
GROUPS: StashKey[SequenceGroups] = StashKey()


def layout(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(sequence groups, data-parallel groups)`` of ``world`` ranks split ``size`` per sequence."""
    sequence = [list(range(start, start + size)) for start in range(0, world, size)]
    data = [list(range(offset, world, size)) for offset in range(size)]
    return sequence, data


def build_groups(size: int, communicator: Any) -> SequenceGroups:
    """Create every sequence and data-parallel group (collective: every rank, same order) and return
    this rank's; ``communicator(group)`` gives the communicator of a group (the engine's assembly)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sequence_groups, data_groups = layout(world, size)
    mine: dict[str, Any] = {}
    for name, groups in (("sequence", sequence_groups), ("data", data_groups)):
        for ranks in groups:
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine[name] = group
    return SequenceGroups(size=size, sequence=mine["sequence"], comm=communicator(mine["sequence"]),
                          data=mine["data"])
