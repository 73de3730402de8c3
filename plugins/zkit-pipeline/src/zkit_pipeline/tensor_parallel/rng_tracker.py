"""RNG state tracking so dropout is right across the tensor group.

Activations that are *replicated* over the tensor group (the residual stream) need the same dropout
mask on every rank of the group; activations that are *split* (attention probabilities of a rank's
heads, an MLP slice) need different masks on each rank, or the model would drop the same pattern
in every slice. The default torch generator serves the first kind (seeded equally over the group);
:func:`get_rng_tracker` keeps a separate, per-rank-seeded state for the second, entered with
``with get_rng_tracker().fork():``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zkit.activations import register_rng_tracker

TENSOR_PARALLEL_RNG = "tensor-parallel"
#: offset between the replicated and the tensor-parallel seeds, so the two streams never coincide.
SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named CPU (and, when present, CUDA) RNG states that code can fork into and back out of."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        self.states.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() first")
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.manual_seed(seed)
        self.states[name] = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda is not None else None)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the named state; save its advance, restore the previous state."""
        if name not in self.states:
            raise ValueError(
                f"RNG state {name!r} is not set; call model_parallel_seed(seed, tensor_rank) first"
            )
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        state_cpu, state_cuda = self.states[name]
        torch.set_rng_state(state_cpu)
        if cuda is not None and state_cuda is not None:
            torch.cuda.set_rng_state(state_cuda)
        try:
            yield
        finally:
            self.states[name] = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda is not None else None)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)


_TRACKER = RNGStatesTracker()
# activation checkpointing replays this stream when it recomputes a region that forked into it
register_rng_tracker(_TRACKER)


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tensor_rank: int) -> None:
    """Seed the default generator with ``seed`` (same on the whole tensor group) and the
    tensor-parallel state with ``seed + SEED_OFFSET + tensor_rank`` (different on each rank)."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL_RNG, seed + SEED_OFFSET + tensor_rank)
