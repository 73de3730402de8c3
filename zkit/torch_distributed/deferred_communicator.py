"""A communicator for objects built before the engine that will train them.

A model split over process groups (zkit-pipeline's tensor-parallel layers, weights tied across
pipeline stages) is built, and may already talk, before ``zkit.initialize`` has chosen the
communicator. It holds a :class:`DeferredCommunicator` over its group instead: until the plugin that
built it hands it an engine's assembly (:meth:`DeferredCommunicator.bind`, from its
``zkit_engine_setup``), calls go to the communicator a default :class:`~zkit.core.assembly.Assembly`
gives for that group (the installed plugins' choice); afterwards to the engine's.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zkit.core.assembly import Assembly
from zkit.core.communicator import Communicator


class DeferredCommunicator(Communicator):
    """Collectives over ``group`` through the communicator an assembly gives for it."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self._target: Communicator | None = None

    def bind(self, assembly: Assembly) -> None:
        """From now on, use ``assembly.communicator(self.group)``."""
        self._target = assembly.communicator(self.group)

    @property
    def target(self) -> Communicator:
        if self._target is None:
            self.bind(Assembly.build())
        assert self._target is not None
        return self._target

    @property
    def backend(self) -> Any:
        return getattr(self.target, "backend", None)

    # counters are the target's: one count per wire, however many holders it has
    def account(self, kind: str, nbytes: int) -> None:
        self.target.account(kind, nbytes)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.target.stats()

    def reset_stats(self) -> None:
        self.target.reset_stats()

    def all_reduce(self, tensor, op="sum", async_op=False, key=None):
        return self.target.all_reduce(tensor, op=op, async_op=async_op, key=key)

    def reduce_scatter(self, output, input, op="sum", async_op=False, key=None):
        return self.target.reduce_scatter(output, input, op=op, async_op=async_op, key=key)

    def all_gather(self, output, input, async_op=False):
        return self.target.all_gather(output, input, async_op=async_op)

    def all_to_all(self, output, input, async_op=False):
        return self.target.all_to_all(output, input, async_op=async_op)

    def broadcast(self, tensor, src, async_op=False):
        return self.target.broadcast(tensor, src, async_op=async_op)

    def send(self, tensor, dst):
        return self.target.send(tensor, dst)

    def recv(self, tensor, src):
        return self.target.recv(tensor, src)

    def isend(self, tensor, dst):
        return self.target.isend(tensor, dst)

    def irecv(self, tensor, src):
        return self.target.irecv(tensor, src)

    def barrier(self):
        return self.target.barrier()

    def all_gather_object(self, obj):
        return self.target.all_gather_object(obj)

    def coalesced(self):
        return self.target.coalesced()

    def subgroup(self, ranks):
        return self.target.subgroup(ranks)
