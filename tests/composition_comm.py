"""The composition matrix's third-party communicator (feature ``custom_comm``): torch's
communicator behind a wrapper that counts every call, given to ``zkit.Stack(communicator=...)`` as a
record of its own (not one that ``wraps`` another: every process group gets it, not only the
data-parallel gradient exchange)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from zkit.core.communicator import Communicator


class CountingCommunicator(Communicator):
    """Delegates every collective to ``inner`` (torch's) and counts the calls by kind."""

    #: groups a Counting communicator was built for in this process (``None``: the default group)
    built: list[Any] = []

    def __init__(self, inner: Communicator, group: Any) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner, self.group = inner, group
        self.calls: Counter[str] = Counter()
        CountingCommunicator.built.append(group)

    def __getattr__(self, name: str) -> Any:  # what torch's communicator has beyond the protocol
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # the counters of bytes are the inner communicator's: one count per wire
    def account(self, kind: str, nbytes: int) -> None:
        self.inner.account(kind, nbytes)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.inner.stats()

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def _call(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        self.calls[kind] += 1
        return getattr(self.inner, kind)(*args, **kwargs)

    def all_reduce(self, tensor, op="sum", async_op=False, key=None):
        return self._call("all_reduce", tensor, op=op, async_op=async_op, key=key)

    def reduce_scatter(self, output, input, op="sum", async_op=False, key=None):
        return self._call("reduce_scatter", output, input, op=op, async_op=async_op, key=key)

    def all_gather(self, output, input, async_op=False):
        return self._call("all_gather", output, input, async_op=async_op)

    def all_to_all(self, output, input, async_op=False):
        return self._call("all_to_all", output, input, async_op=async_op)

    def broadcast(self, tensor, src, async_op=False):
        return self._call("broadcast", tensor, src, async_op=async_op)

    def send(self, tensor, dst):
        return self._call("send", tensor, dst)

    def recv(self, tensor, src):
        return self._call("recv", tensor, src)

    def isend(self, tensor, dst):
        return self._call("isend", tensor, dst)

    def irecv(self, tensor, src):
        return self._call("irecv", tensor, src)

    def barrier(self):
        return self._call("barrier")

    def all_gather_object(self, obj):
        return self._call("all_gather_object", obj)

    def coalesced(self):
        return self.inner.coalesced()

    def subgroup(self, ranks):
        sub = self.inner.subgroup(ranks)
        return CountingCommunicator(sub, getattr(sub, "group", None))

    def close(self) -> None:
        self.inner.close()


def record():
    """The record a Stack takes: torch's record's communicator, wrapped."""
    from zkit.core.plugin_manager import get_plugin_manager
    from zkit.core.records import CommunicatorRecord

    torch_record = get_plugin_manager().lookup("communicator", "torch")

    def factory(group, config):
        return CountingCommunicator(torch_record.factory(group, config), group)

    return CommunicatorRecord(name="counting", factory=factory, dist="tests")


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
