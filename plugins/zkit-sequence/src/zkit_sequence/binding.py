"""How a model's sequence-parallel parts learn their group: each is a :class:`SequenceParallel`
module, bound to the communicator of its sequence-parallel ranks when an engine with
``sequence_parallel_size`` > 1 is built. Unbound, a part computes as on one rank (the whole
sequence), so one model runs with and without sequence parallelism."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class SequenceParallel(Protocol):
    """A module whose computation spans the ranks that split a sequence."""

    def bind_sequence(self, comm: Any) -> None:
        """Compute over the ranks of ``comm`` (each holding a slice of every sequence); refuse
        here, with the numbers, a geometry those ranks cannot split."""
        ...


def bind_model(model: nn.Module, comm: Any) -> list[str]:
    """Bind every :class:`SequenceParallel` module of ``model`` to ``comm``; their names."""
    bound = []
    for name, module in model.named_modules():
        if isinstance(module, SequenceParallel):
            module.bind_sequence(comm)
            bound.append(name)
    return bound
