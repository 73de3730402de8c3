"""One verdict on every rank: a checkpoint load or save (or one step of it, such as creating a
directory on the first rank) that fails on some ranks fails on all of them, with one message naming
each failing rank and what failed there, and no rank waits in a later collective for a rank that
gave up.

Each step that can fail on some ranks only is followed by an agreement: every rank gathers every
rank's failure (an all-gather of short messages, the cost of a barrier), and if there is any, every
rank raises. A rank's own exception is re-raised unchanged when every rank failed with the same
message (a single rank always: nothing to agree on); otherwise every rank raises the same
:class:`~zkit.core.checkpoint_errors.CheckpointError`, ``"<what> failed; rank 1: <its message>"``
(ranks with the same message listed together), chained to its own exception where it had one.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from zkit.core.checkpoint_errors import CheckpointError
from zkit.core.communicator import Communicator


def agree(comm: Communicator, what: str, failure: Exception | None) -> None:
    """Raise on every rank of ``comm`` if ``failure`` is not None on any (see the module
    docstring); every rank must call it. ``what`` names the operation (``"saving checkpoint 't'"``)."""
    if comm.world_size == 1:
        if failure is not None:
            raise failure
        return
    gathered = comm.all_gather_object(None if failure is None else str(failure))
    failed = {rank: message for rank, message in enumerate(gathered) if message is not None}
    if not failed:
        return
    if failure is not None and len(failed) == len(gathered) and len(set(failed.values())) == 1:
        raise failure  # the same verdict on every rank, reached by each
    raise CheckpointError(f"{what} failed; {describe(failed)}") from failure


def describe(failed: dict[int, str]) -> str:
    """``rank 1: <message>; ranks 0, 2: <message>``: each message once, with the ranks that gave it."""
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(failed.items()):
        by_message.setdefault(message, []).append(rank)
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in by_message.items()
    )


@contextlib.contextmanager
def agreed(comm: Communicator, what: str) -> Iterator[None]:
    """Run the block on every rank of ``comm``, then :func:`agree` on its outcome: an exception
    the block raises on one rank is raised on all (a ``BaseException`` that is not an
    ``Exception``, an interrupt, passes through unagreed)."""
    try:
        yield
    except Exception as exc:
        agree(comm, what, exc)
        raise  # agree raised already; for type checkers
    agree(comm, what, None)
