"""Stage-3 parameter shards kept in memory: the :class:`~zkit.core.stores.ParamShardStore` of every
:class:`~zkit.zero.sharded_params.ShardedUnit` whose allocator provides no store (zkit-offload's NVMe
store is one that does), so stage 3 reads and writes every shard the same way.

A shard here is the unit's own tensor ``su.shard`` (on the device, or on the host where the
allocator places purpose ``"param"`` there): :meth:`~InMemoryParamShardStore.get` gives it, with no
read to wait for and nothing to read ahead. What truly differs for a store whose shards leave memory
is said by two attributes, which stage 3 reads instead of asking whether there is a store:
:attr:`~InMemoryParamShardStore.shards_leave_memory` and
:attr:`~InMemoryParamShardStore.may_wait_for_buffer`.

The store holds nothing of its own, so one object (:data:`IN_MEMORY`) serves every unit.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from zkit.core.stores import ParamShardStore


class InMemoryParamShardStore:
    """Each shard is ``su.shard``, in memory."""

    #: none of its own: each shard keeps its dtype (``su.shard.dtype``)
    dtype = None
    #: nothing to read ahead of a gather
    lookahead = 0
    #: the shards stay in memory: a gather reads ``su.shard`` itself, the optimizer may step it in
    #: place (fp32 master = the parameters), and a copy-out may write it
    shards_leave_memory = False
    #: :meth:`get` never waits for a gather in flight to free a buffer: gathers may be batched
    may_wait_for_buffer = False

    def adopt(self, units: Sequence[Any]) -> None:
        """Take shards another store held back into memory (those in memory already stay)."""
        for su in units:
            if su.store is not self:
                su.shard_to_memory()

    def take(self, su: Any, allocator: Any = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """``su.shard`` (copied into ``into`` when given)."""
        return su.shard if into is None else into.copy_(su.shard)

    def prefetch(self, su: Any) -> None:
        """Nothing to read."""

    def ready(self, su: Any) -> bool:
        return True

    def get(self, su: Any) -> torch.Tensor:
        return su.shard

    def release(self, su: Any) -> None:
        """Nothing held."""

    def put(self, su: Any, values: torch.Tensor) -> None:
        """Copy ``values`` into ``su.shard`` (``su.allocator.copies``: asynchronously, tracked in
        ``su.copy``)."""
        if su.shard.device.type == "cpu":
            su.copy.synchronize()  # a gather's copy may still be reading the old values
        su.copy = su.allocator.copies.copy(su.shard, values)


#: the in-memory store every unit starts in
IN_MEMORY = InMemoryParamShardStore()

#: what a store must have to be a :class:`~zkit.core.stores.ParamShardStore`: its attributes and
#: public methods (``isinstance`` on the protocol would not name what is missing)
PARAM_SHARD_STORE_MEMBERS: tuple[str, ...] = (
    *ParamShardStore.__annotations__,
    *(name for name, value in vars(ParamShardStore).items() if callable(value) and not name.startswith("_")),
)


def param_shard_store(allocator: Any, dtype: torch.dtype) -> Any:
    """Where stage-3 shards of ``dtype`` live: ``allocator``'s store, else memory. A store that
    lacks a member of :class:`~zkit.core.stores.ParamShardStore` is refused here, at set-up,
    naming what it lacks."""
    store = allocator.param_shard_store(dtype)
    if store is None:
        return IN_MEMORY
    missing = sorted(name for name in PARAM_SHARD_STORE_MEMBERS if not hasattr(store, name))
    if missing:
        raise TypeError(f"{type(allocator).__name__}.param_shard_store() returned {type(store).__name__}, which is "
                        f"not a zkit.core.stores.ParamShardStore: it lacks {', '.join(missing)}")
    return store
