"""The default communicator: torch.distributed collectives (gloo on CPU, NCCL on GPU) with byte
counters. Other communicators (1-bit compression) wrap or subclass this one. How the flat
all-gather and reduce-scatter run on the backend is chosen once, in :mod:`zkit.torch_distributed.collectives`."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

import zkit
from zkit.torch_distributed import diagnostics
from zkit.torch_distributed import collectives
from zkit.torch_distributed import traced_collectives as traced
from zkit.core.communicator import Communicator, DoneHandle, check_op
from zkit.core.records import CommunicatorRecord

class _AvgHandle:
    """Completes an ``avg`` the backend lacks (gloo): sum, then divide once the sum is done."""

    def __init__(self, work, tensor: torch.Tensor, n: int) -> None:
        self.work, self.tensor, self.n = work, tensor, n

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.tensor.div_(self.n)
            self.work = None


class _Batch:
    """The collectives issued inside one :meth:`TorchCommunicator.coalesced` block: one work,
    known when the block ends; every member's handle waits for it."""

    def __init__(self) -> None:
        self.members = 0
        self.manager: Any = None  # the coalescing manager, once the block has ended
        self.done = False

    def member(self) -> "_Batch":
        self.members += 1
        return self

    def wait(self) -> None:
        if self.manager is None:
            # a ValueError: a usage error, not a collective failure to report across ranks
            raise ValueError("a collective issued inside comm.coalesced() was waited for inside the block; "
                               "wait after the block, when the batch has been launched")
        if not self.done:  # once: gloo's coalesced work copies its results out again at every wait
            self.manager.wait()
            self.done = True


class _Watched:
    """A handle whose failure (timeout, lost peer) becomes a cross-rank report."""

    def __init__(self, inner: Any, comm: "TorchCommunicator") -> None:
        self.inner, self.comm = inner, comm

    def wait(self) -> None:
        with self.comm.watch():
            self.inner.wait()


class TorchCommunicator(Communicator):
    """torch.distributed over one process group (``None`` = the default group).

    With a collective timeout (``comms_timeout_s``, ``ZKIT_COMMS_TIMEOUT_S``) the communicator runs
    on its own group with that timeout, and a collective that fails raises
    :class:`zkit.torch_distributed.diagnostics.CollectiveFailed` with every rank's last fingerprints.
    ``flat_collectives`` (``"native"`` or ``"per_rank"``) overrides the backend's choice of
    flat collectives (:func:`zkit.torch_distributed.collectives.choose`)."""

    def __init__(self, group: Any = None, config: Any = None, flat_collectives: str | None = None) -> None:
        timeout = diagnostics.timeout_seconds(config)
        self._own_group = None
        self._closed = False
        if group is None and timeout and dist.get_world_size() > 1:
            group = self._own_group = dist.new_group(timeout=diagnostics.as_timedelta(timeout))
        self._group = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.backend = dist.get_backend(group)
        self.flat = collectives.choose(self.backend, flat_collectives, self.world_size)
        self._batch: _Batch | None = None
        # Global rank -> rank in this group, for send/recv/broadcast, which take global ranks.
        self._global_ranks = (
            list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        )
        name = "world" if len(self._global_ranks) == dist.get_world_size() else ",".join(map(str, self._global_ranks))
        self.fingerprints = diagnostics.FingerprintLog(name)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Turn a failing collective into a :class:`zkit.torch_distributed.diagnostics.CollectiveFailed` report."""
        try:
            yield
        except diagnostics.CollectiveFailed:
            raise
        except RuntimeError as exc:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # no store: report this rank alone
                store = None
            raise diagnostics.CollectiveFailed(
                diagnostics.report(self.fingerprints, dist.get_rank(), self._global_ranks, exc, store)
            ) from exc

    @property
    def group(self) -> Any:
        """The process group the collectives run on (``None``: the default group)."""
        if self._closed:
            # ValueError, as for I/O on a closed file; a RuntimeError would read as a failed collective
            raise ValueError("this communicator was closed (engine.close() destroyed its process group): "
                             "build a new engine to train on")
        return self._group

    def close(self) -> None:
        """Destroy the group this communicator created and drop the last reference to it, so its
        worker threads are joined now, while the interpreter is whole. Left alive until the
        interpreter's exit, a worker thread that releases the last reference to a finished
        collective's tensor needs the interpreter's lock, and a finalizing interpreter ends such a
        thread: the process aborts ("terminate called without an active exception", SIGABRT)
        after the script finished. The caller has waited for every collective it issued."""
        if self._own_group is None:
            return
        group, self._own_group, self._group, self._closed = self._own_group, None, None, True
        dist.destroy_process_group(group)

    @contextlib.contextmanager
    def coalesced(self) -> Iterator[None]:
        """Flat collectives of one kind issued inside the block (``async_op=True``) go out as one
        batch where the backend batches them (one NCCL launch); each handle waits for the batch.
        Elsewhere (gloo's per-rank collectives) they are issued one by one, as outside."""
        if self._batch is not None or not self.flat.coalesces or self.world_size == 1:
            yield
            return
        batch = self._batch = _Batch()
        try:
            with dist._coalescing_manager(group=self.group, async_ops=True) as manager:
                yield
        except BaseException:
            # torch keeps the collectives recorded by a block that raised: drop them, or the
            # next block of this group would refuse to start
            c10d = dist.distributed_c10d
            c10d._world.pg_coalesce_state.pop(self.group or c10d._get_default_group(), None)
            raise
        finally:
            self._batch = None
        if batch.members:
            batch.manager = manager

    def _check_batched(self, async_op: bool) -> None:
        if self._batch is not None and not async_op:
            raise ValueError("collectives inside comm.coalesced() must be issued with async_op=True")

    def _flat_work(self, work):
        """A flat collective's work, or its batch's inside :meth:`coalesced`."""
        return work if self._batch is None else self._batch.member()

    def _finish(self, work, async_op: bool, post=None):
        handle = post(work) if post else work
        handle = _Watched(handle, self) if handle is not None else None
        if async_op:
            return handle if handle is not None else DoneHandle()
        if handle is not None:
            handle.wait()
        return None

    def _reduce(self, tensor: torch.Tensor, op: str, run) -> Any:
        """Run a reducing collective, doing ``avg`` as sum + divide where the backend lacks it."""
        check_op(op)
        backend_op, divide = self.flat.reduce_op(op)
        return run(backend_op), ((lambda w: _AvgHandle(w, tensor, self.world_size)) if divide else None)

    def all_reduce(self, tensor, op="sum", async_op=False, key=None):
        if traced.tracing():  # inside a compiled graph: no counters, no fingerprint (see traced_collectives)
            check_op(op)
            if self.world_size > 1:
                traced.all_reduce(tensor, op, self.group, self.world_size, self.flat)
            return DoneHandle() if async_op else None
        self.account("all_reduce", self.ring_bytes("all_reduce", _nbytes(tensor)))
        self.fingerprints.record("all_reduce", tensor)
        if self.world_size == 1:
            return DoneHandle() if async_op else None
        work, post = self._reduce(
            tensor, op, lambda o: dist.all_reduce(tensor, op=o, group=self.group, async_op=True)
        )
        return self._finish(work, async_op, post)

    def reduce_scatter(self, output, input, op="sum", async_op=False, key=None):
        _check_sizes("reduce_scatter", output, input, self.world_size)
        if traced.tracing():
            check_op(op)
            if self.world_size == 1:
                output.copy_(input)
            else:
                traced.reduce_scatter(output, input, op, self.group, self.world_size, self.flat)
            return DoneHandle() if async_op else None
        self._check_batched(async_op)
        self.account("reduce_scatter", self.ring_bytes("reduce_scatter", _nbytes(input)))
        self.fingerprints.record("reduce_scatter", input)
        if self.world_size == 1:
            output.copy_(input)
            return DoneHandle() if async_op else None
        work, post = self._reduce(
            output, op, lambda o: self.flat.reduce_scatter(output, input, o, self.rank, self._global_ranks, self.group)
        )
        return self._finish(self._flat_work(work), async_op, post)

    def all_gather(self, output, input, async_op=False):
        _check_sizes("all_gather", input, output, self.world_size)
        if traced.tracing():
            if self.world_size == 1:
                output.copy_(input)
            else:
                traced.all_gather(output, input, self.group)
            return DoneHandle() if async_op else None
        self._check_batched(async_op)
        self.account("all_gather", self.ring_bytes("all_gather", _nbytes(output)))
        self.fingerprints.record("all_gather", output)
        if self.world_size == 1:
            output.copy_(input)
            return DoneHandle() if async_op else None
        work = self.flat.all_gather(output, input, self.rank, self._global_ranks, self.group)
        return self._finish(self._flat_work(work), async_op)

    def all_to_all(self, output, input, async_op=False):
        if output.numel() != input.numel() or input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all needs input and output of one size divisible by the world size "
                f"{self.world_size}; got {input.numel()} and {output.numel()}"
            )
        self.account("all_to_all", self.ring_bytes("all_to_all", _nbytes(input)))
        self.fingerprints.record("all_to_all", input)
        if self.world_size == 1:
            output.copy_(input)
            return DoneHandle() if async_op else None
        work = dist.all_to_all_single(output, input, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def broadcast(self, tensor, src, async_op=False):
        if not tensor.is_contiguous():
            # gloo writes a tensor's numel() elements from its first one: into an expanded or strided
            # view (a released stage-3 placeholder) that writes past its memory
            raise ValueError(f"broadcast into a non-contiguous tensor (shape {tuple(tensor.shape)}, stride "
                             f"{tensor.stride()}): it would write past the tensor's memory; broadcast a "
                             f"contiguous copy and copy it back")
        self.account("broadcast", _nbytes(tensor) if dist.get_rank() == src else 0)
        self.fingerprints.record("broadcast", tensor)
        if self.world_size == 1:
            return DoneHandle() if async_op else None
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def send(self, tensor, dst):
        self.account("send", _nbytes(tensor))
        self.fingerprints.record("send", tensor)
        with self.watch():
            dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor, src):
        self.account("recv", 0)
        self.fingerprints.record("recv", tensor)
        with self.watch():
            dist.recv(tensor, src=src, group=self.group)

    def isend(self, tensor, dst):
        self.account("send", _nbytes(tensor))
        self.fingerprints.record("send", tensor)
        with self.watch():
            return dist.isend(tensor, dst=dst, group=self.group)

    def irecv(self, tensor, src):
        self.account("recv", 0)
        self.fingerprints.record("recv", tensor)
        with self.watch():
            return dist.irecv(tensor, src=src, group=self.group)

    def barrier(self):
        self.fingerprints.record("barrier")
        if self.world_size > 1:
            with self.watch():
                dist.barrier(group=self.group)

    def all_gather_object(self, obj):
        out: list[Any] = [None] * self.world_size
        self.fingerprints.record("all_gather_object")
        if self.world_size == 1:
            return [obj]
        with self.watch():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def subgroup(self, ranks: Sequence[int], backend: str | None = None) -> "TorchCommunicator":
        """A communicator of this kind over a new group of ``ranks`` (collective over the world),
        on ``backend`` (default: the default group's)."""
        group = dist.new_group(ranks=sorted(ranks), backend=backend)
        return type(self)(group, flat_collectives=self.flat.kind if backend is None else None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_sizes(kind: str, shard: torch.Tensor, full: torch.Tensor, n: int) -> None:
    if full.numel() != shard.numel() * n:
        raise ValueError(
            f"{kind}: the full tensor must hold world size ({n}) x shard elements; got shard "
            f"{shard.numel()} and full {full.numel()}"
        )


@zkit.hookimpl(trylast=True)
def zkit_register_communicators():
    yield CommunicatorRecord(
        name="torch",
        factory=TorchCommunicator,
        description="torch.distributed collectives (gloo on CPU, NCCL on GPU)",
        aliases=("torch.distributed",),
    )
