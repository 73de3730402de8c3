"""Stage-3 parameter shards on NVMe (ZeRO-Infinity's parameter offload).

Stage 3 asks its allocator for a *shard store* (``param_shard_store(dtype)``) and hands it the
shards of its units (:meth:`NVMeParamStore.adopt`). The first ``max_in_cpu`` elements of shards
(in unit order) stay in host memory, as in DeepSpeed; each other shard is written to its own swap
file and its memory freed. From then on the store keeps at most ``buffer_count`` shards resident,
in aligned host buffers of ``min(buffer_size, largest shard)`` elements:

* :meth:`prefetch` starts reading a shard into a free buffer (stage 3 calls it for the units
  after the ones it is gathering, in its recorded module order);
* :meth:`ready` says whether a shard's read has finished (stage 3 with one rank gathers ahead only
  shards already read, so it never waits on the disk before it must);
* :meth:`get` returns the shard in memory for a gather (waiting for its read) and holds the buffer
  until :meth:`release` (the gather is done);
* :meth:`put` writes new values (after the optimizer step) asynchronously through a buffer: the
  shard's own when it is resident, else an idle one (which then holds the new values). A put
  never takes a buffer from a gather or a read-ahead: with ``step_in_backward`` the puts come
  during backward, while the buffers hold the next units' shards, and then go through two staging
  buffers of their own (made at the first such put).

A buffer keeps the last shard it held until it is needed for another, so the units used last in
forward are often still resident when backward starts. A shard written by :meth:`put` stays in its
buffer until that write has finished, so a read never sees a half-written file.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from zkit.host_memory import trim
from zkit_offload.swap import NVMeSwapper, SwapHandle, aligned_empty


class _Buffer:
    __slots__ = ("data", "unit", "read", "write", "users", "prefetched", "tick")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.unit: Any = None  # the ShardedUnit whose shard this buffer holds
        self.read: SwapHandle | None = None
        self.write: SwapHandle | None = None
        self.users = 0  # gathers reading from the buffer now
        self.prefetched = False  # read ahead, not used yet: other read-aheads leave it alone
        self.tick = 0


class NVMeParamStore:
    """Parameter shards in swap files, read into ``buffer_count`` host buffers on demand.

    Its shards leave memory (:attr:`shards_leave_memory`), and :meth:`get` may wait for a gather
    in flight to free a buffer (:attr:`may_wait_for_buffer`).

    Args:
        swapper: the swapper of ``offload_param.nvme_path``.
        allocator: counts the buffers as purpose ``"param"`` host memory.
        dtype: the shards' dtype (the model's).
        buffer_count, buffer_size, max_in_cpu: ``zero_optimization.offload_param`` settings.
    """

    shards_leave_memory = True
    may_wait_for_buffer = True

    def __init__(self, swapper: NVMeSwapper, allocator: Any, dtype: torch.dtype, *, buffer_count: int,
                 buffer_size: int, max_in_cpu: int) -> None:
        if buffer_count < 1:
            raise ValueError("zero_optimization.offload_param.buffer_count must be at least 1 with device 'nvme' "
                             f"(a gather reads its shard into a buffer); got {buffer_count}")
        self.swapper = swapper
        self.allocator = allocator
        self.dtype = dtype
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.max_in_cpu = max_in_cpu
        self.buffers: list[_Buffer] = []
        self._key: dict[int, str] = {}
        self._where: dict[int, _Buffer] = {}
        self._clock = itertools.count(1)
        self._serial = itertools.count()
        self._in_cpu = 0  # elements of adopted shards kept in host memory (max_in_cpu)
        #: put()'s two staging buffers (made at its first put of a shard not resident), their
        #: writes in flight, and per shard (by ``id``) its put in flight, which a read waits for
        self._put_staging: list[torch.Tensor] = []
        self._put_writes: list[SwapHandle | None] = [None, None]
        self._put_turn = 0
        self._put_pending: dict[int, SwapHandle] = {}
        #: bytes of shards in swap files
        self.nvme_bytes = 0

    @property
    def lookahead(self) -> int:
        """How many units past the gathered ones stage 3 reads ahead (one buffer stays free for
        a gather that is not in the recorded order)."""
        return max(self.buffer_count - 1, 0)

    # -- set-up ----------------------------------------------------------------------------------
    def adopt(self, units: Sequence[Any]) -> None:
        """Move the shards of ``units`` to NVMe, except the first ``max_in_cpu`` elements' worth
        (over all calls), which stay in host memory. A shard is in memory (``su.shard``) or in
        another store (a model built under ``zkit.zero.Init`` with this config): it is then moved
        one unit at a time, so host memory never holds more than one of them."""
        swapped = []
        for su in units:
            n = su.unit.shard
            if self._in_cpu + n <= self.max_in_cpu:
                self._in_cpu += n
                if su.shard is None:  # in another store
                    su.shard_to_memory(self.allocator)
            else:
                swapped.append(su)
        largest = max(swapped, key=lambda su: su.unit.shard, default=None)
        if largest is not None and largest.unit.shard > self.buffer_size:
            raise ValueError(
                f"stage-3 module {largest.module_name or 'root'!r} has a parameter shard of {largest.unit.shard} "
                f"elements, more than zero_optimization.offload_param.buffer_size ({self.buffer_size} elements); "
                f"raise buffer_size to at least {largest.unit.shard}"
            )
        if not swapped:
            return
        self._grow_buffers(max(su.unit.shard for su in swapped))
        writes = []
        for su in swapped:
            key = f"param{next(self._serial)}.{su.module_name or 'root'}"
            self._key[id(su)] = key
            if su.shard is None:  # another store's: through this store's first buffer
                staging = self.buffers[0]
                if staging.unit is not None:
                    self.flush()
                    del self._where[id(staging.unit)]
                    staging.unit = None
                view = staging.data[: su.unit.shard]
                su.store.take(su, into=view)
                self.swapper.write(key, view)
                self.nvme_bytes += view.numel() * view.element_size()
                su.stored_in(self)
                continue
            shard = su.shard.contiguous() if su.shard.device.type == "cpu" else su.shard.cpu()
            writes.append((su, shard, self.swapper.swap_out(key, shard)))
        for su, shard, handle in writes:
            handle.wait()
            self.allocator.release(su.shard, "param")
            self.nvme_bytes += shard.numel() * shard.element_size()
            su.stored_in(self)
        writes.clear()
        shard = None  # noqa: F841 - the last shard's memory too
        trim()  # the shards' memory, back to the OS

    def take(self, su: Any, allocator: Any = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """Remove ``su``'s shard from this store and return it: read into ``into``, or into a new
        buffer from ``allocator`` (purpose ``"param"``). Its swap file is deleted."""
        self.flush()
        buf = self._where.pop(id(su), None)
        if buf is not None:
            buf.unit, buf.users, buf.prefetched = None, 0, False
        key = self._key.pop(id(su))
        if into is None:
            into = allocator.empty(su.unit.shard, self.dtype, "param")
        self.swapper.read(key, into)
        self.swapper.remove(key)
        self.nvme_bytes -= into.numel() * into.element_size()
        return into

    def _grow_buffers(self, size: int) -> None:
        """At least ``buffer_count`` buffers of ``size`` elements (a later :meth:`adopt` may bring
        a larger shard; nothing is resident while units are being adopted)."""
        if self.buffers and self.buffers[0].data.numel() >= size:
            return
        self.flush()
        for b in self.buffers:
            if b.unit is not None:
                del self._where[id(b.unit)]
        self.allocator.track("param", -sum(b.data.numel() * b.data.element_size() for b in self.buffers))
        self.allocator.track("param", -sum(t.numel() * t.element_size() for t in self._put_staging))
        self._put_staging = []  # made again at the new size by the next put
        self.buffers = [_Buffer(aligned_empty(size, self.dtype)) for _ in range(self.buffer_count)]
        self.allocator.track("param", sum(b.data.numel() * b.data.element_size() for b in self.buffers))

    # -- reads -----------------------------------------------------------------------------------
    def prefetch(self, su: Any) -> None:
        """Start reading ``su``'s shard if a buffer is free for it (best effort, never waits for
        a gather)."""
        buf = self._where.get(id(su))
        if buf is None:
            idle = self._idle_buffer()
            if idle is None:
                return
            buf = self._claim(idle, su)
            buf.prefetched = True
        buf.tick = next(self._clock)

    def ready(self, su: Any) -> bool:
        """Whether ``su``'s shard is in a buffer with its read finished (:meth:`get` would not wait)."""
        buf = self._where.get(id(su))
        return buf is not None and (buf.read is None or buf.read.done())

    def get(self, su: Any) -> torch.Tensor:
        """``su``'s shard in a host buffer, held until :meth:`release`."""
        buf = self._where.get(id(su))
        if buf is None:
            buf = self._claim(self._free_buffer(), su)
        if buf.read is not None:
            buf.read.wait()
            buf.read = None
        buf.users += 1
        buf.prefetched = False
        buf.tick = next(self._clock)
        return buf.data[: su.unit.shard]

    def release(self, su: Any) -> None:
        """The gather that read ``su``'s shard is done with it."""
        buf = self._where.get(id(su))
        if buf is not None and buf.users:
            buf.users -= 1

    # -- writes ----------------------------------------------------------------------------------
    def put(self, su: Any, values: torch.Tensor) -> None:
        """New values of ``su``'s shard: written to its file, asynchronously (module docstring)."""
        buf = self._where.get(id(su))
        if buf is None:
            idle = self._idle_buffer()
            if idle is None:  # every buffer feeds a gather or holds a read-ahead: keep them
                self._put_staged(su, values)
                return
            buf = self._claim(idle, su, read=False)
        if buf.users:
            raise RuntimeError(f"the shard of stage-3 module {su.module_name or 'root'!r} was changed while a "
                               "gather was reading it")
        for handle in (buf.read, buf.write):
            if handle is not None:
                handle.wait()
        buf.read = None
        view = buf.data[: su.unit.shard]
        view.copy_(values)
        buf.write = self.swapper.swap_out(self._key[id(su)], view)
        buf.tick = next(self._clock)

    def _put_staged(self, su: Any, values: torch.Tensor) -> None:
        if not self._put_staging:
            size = self.buffers[0].data.numel()
            self._put_staging = [aligned_empty(size, self.dtype) for _ in range(2)]
            self.allocator.track("param", sum(t.numel() * t.element_size() for t in self._put_staging))
        self._put_turn ^= 1
        before = self._put_writes[self._put_turn]
        if before is not None:
            before.wait()  # the staging buffer's last write
        earlier = self._put_pending.pop(id(su), None)
        if earlier is not None:
            earlier.wait()  # two puts of one shard land in order
        view = self._put_staging[self._put_turn][: su.unit.shard]
        view.copy_(values)
        handle = self.swapper.swap_out(self._key[id(su)], view)
        self._put_writes[self._put_turn] = handle
        self._put_pending[id(su)] = handle

    def flush(self) -> None:
        """Wait for every read and write in flight (raises the first I/O error)."""
        for buf in self.buffers:
            for handle in (buf.read, buf.write):
                if handle is not None:
                    handle.wait()
            buf.read = buf.write = None
        for handle in self._put_writes:
            if handle is not None:
                handle.wait()
        self._put_writes, self._put_pending = [None, None], {}

    # -- buffers ---------------------------------------------------------------------------------
    def _idle_buffer(self) -> _Buffer | None:
        """A buffer neither a gather nor a read-ahead needs (an empty one first, else the least
        recently used), or ``None``."""
        idle = [b for b in self.buffers if b.users == 0 and not b.prefetched]
        return min(idle, key=lambda b: (b.unit is not None, b.tick), default=None)

    def _free_buffer(self) -> _Buffer:
        free = [b for b in self.buffers if b.users == 0]
        if not free:
            # Every buffer feeds a gather in flight (read-aheads): finish the oldest one.
            oldest = min(self.buffers, key=lambda b: b.tick)
            oldest.unit.wait()
            free = [oldest]
        return min(free, key=lambda b: (b.unit is not None, b.tick))

    def _claim(self, buf: _Buffer, su: Any, read: bool = True) -> _Buffer:
        """Make ``buf`` hold ``su``'s shard (reading it from its file unless ``read`` is False)."""
        for handle in (buf.read, buf.write):
            if handle is not None:
                handle.wait()  # the buffer's previous shard is fully read / written back
        buf.read = buf.write = None
        if buf.unit is not None:
            del self._where[id(buf.unit)]
        buf.unit, buf.prefetched = su, False
        self._where[id(su)] = buf
        put = self._put_pending.pop(id(su), None)
        if put is not None:
            put.wait()  # the file is being written with the shard's new values
        if read:
            buf.read = self.swapper.swap_in(self._key[id(su)], buf.data[: su.unit.shard])
        return buf
