"""RNG streams besides torch's default generators that recomputation must replay.

torch's checkpoint restores the default CPU and device generators, which covers dropout on
activations replicated over the tensor-parallel group. Dropout on *split* activations draws from
zkit-pipeline's tensor-parallel tracker (``get_rng_tracker().fork()``), a separate, per-rank
stream; its state is captured when a region first runs and put back while it is recomputed, then
the state the forward pass left is restored, so training continues on the same stream as
without checkpointing. zkit-pipeline registers its tracker when that module loads; any object with
a ``states`` dict of named generator states can be registered the same way.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

_registered: list[Any] = []


def register_rng_tracker(tracker: Any) -> None:
    """Also replay ``tracker`` (an object with a ``states`` dict) in recomputation."""
    if not isinstance(getattr(tracker, "states", None), dict):
        raise TypeError(
            f"an RNG tracker needs a 'states' dict of named generator states, got {type(tracker).__name__}"
        )
    if all(t is not tracker for t in _registered):
        _registered.append(tracker)


def trackers() -> list[Any]:
    """The registered trackers, in the order they were registered."""
    return list(_registered)


class TrackerStates:
    """The named states of every tracker at one moment."""

    def __init__(self) -> None:
        # Tracker states are replaced on every fork (never mutated), so a shallow copy is a snapshot.
        self.saved = [(t, dict(t.states)) for t in trackers()]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from the captured states; afterwards, the states from before it."""
        current = [(t, dict(t.states)) for t, _ in self.saved]
        for tracker, states in self.saved:
            tracker.states.clear()
            tracker.states.update(states)
        try:
            yield
        finally:
            for tracker, states in current:
                tracker.states.clear()
                tracker.states.update(states)
