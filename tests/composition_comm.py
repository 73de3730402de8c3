"""The composition matrix's third-party communicator (feature ``custom_comm``): torch's
communicator behind a wrapper that counts every call (``zkit.testing.CountingCommunicator``),
given to ``zkit.Stack(communicator=...)`` as a record of its own (not one that ``wraps`` another:
every process group gets it, not only the data-parallel gradient exchange)."""
from __future__ import annotations

from typing import Any

from zkit.testing import CountingCommunicator, counting_communicator_record


def record():
    """The record a Stack takes: torch's record's communicator, wrapped."""
    return counting_communicator_record("counting")


def reduced_through(engine: Any, built: list[Any], replicas: int, tensor_or_pipeline: bool) -> str | None:
    """What shows the engine's communicators are the counting ones: its gradient communicator is
    one and (with more than one replica) reduced through it; with pipeline or tensor parallelism,
    one was ``built`` (during the run) for a group other than the default one."""
    comm = engine.comm
    if not isinstance(comm, CountingCommunicator):
        return f"the engine reduces through {comm!r}"
    if replicas > 1 and not (comm.calls["all_reduce"] or comm.calls["reduce_scatter"]):
        return f"no gradient was reduced through the counting communicator: {dict(comm.calls)}"
    if tensor_or_pipeline and not any(g is not None for g in built):
        return "every counting communicator is the default group's: the grid's groups came from elsewhere"
    return None
