"""Run a function on N ranks, each a real process in a gloo group on loopback, with a timeout.

    results = run_ranks(my_check, world_size=2, args=(cfg,), timeout=120)

``my_check(*args)`` runs once per rank, inside an initialised ``torch.distributed`` group, and returns a
picklable value; ``run_ranks`` returns the values in rank order. A rank that raises makes ``run_ranks``
raise :class:`RanksFailed` with that rank's traceback as soon as it is known (the other ranks are killed,
never left hanging), and says of each other rank whether it returned, still ran, or ended without a
traceback (its exit code or signal); a rank that returns keeps its end of the group open until
every rank has returned, so that a function needing no collective never fails a slower rank. A job
that does not finish within ``timeout`` seconds raises :class:`RanksTimedOut` naming the ranks that
had not finished. The function must be importable by name (module level): ranks
start as fresh interpreters would, never as forks of the caller (a fork of a process that ran torch's
thread pool hangs in it).

**Start-up.** By default every rank is a new interpreter (``spawn``), which imports torch again:
about 2 s a job on 2 cores. ``start="forkserver"`` (or ``ZKIT_RANKS_START=forkserver``, which this
repository's test suite sets) forks ranks from multiprocessing's *forkserver* instead: a process
started once that has imported torch and nothing else, so it has no thread pool to pass on, and a
rank starts in a fraction of a second. Each rank still receives the caller's environment and
``sys.path`` as of the call. What a forked rank does not get afresh: a variable read only when a
process starts (glibc's ``MALLOC_*``), and its own copy of torch's pages, which a memory cgroup the
rank joins does not count. Benchmarks that measure memory therefore keep ``spawn``.

Also here for tests: :class:`CountingBackend` (a ``torch.compile`` backend counting graphs),
:class:`OpsOutsideCompiledGraphs` (the aten ops a call dispatches outside compiled graphs),
:class:`CountingCommunicator` with :func:`counting_communicator_record` (a third-party
communicator: torch's, counting its calls), and :func:`count_step` (:mod:`zkit.step_counts`: the
ops, host-device syncs and collectives one training step dispatches).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections import Counter
from typing import Any, Callable, Sequence

from torch.utils._python_dispatch import TorchDispatchMode

from zkit.core.communicator import Communicator
from zkit.rank_failures import is_secondary
from zkit.step_counts import OpCounter, StepCounts, count_step, storages_of  # noqa: F401 - test helpers


class RanksFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RanksTimedOut(RuntimeError):
    """The ranks did not all finish within the timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, args, kwargs, rank, world_size, port, threads, env, results, release, timeout) -> None:
    # A forked rank inherits the forkserver's environment, frozen when it started: take the
    # caller's as of this call instead (what a spawned rank would have).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            # Plain pickle copies tensor bytes; the queue's default would pass file descriptors that
            # die with this process.
            reply = (rank, True, pickle.dumps(fn(*args, **kwargs)))
        except BaseException:
            # Destroying a group waits for no one: a rank that fails must not hang the others.
            dist.destroy_process_group()
            raise
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put(reply)
    # A rank that has returned keeps its end of the group open until every rank has returned:
    # gloo connects the ranks' pairs while they already run, so a rank that exits at once (its
    # function needed no collective) closes a pair that a slower rank is still connecting, which
    # fails there with "Connection closed by peer"; and rank 0 serves the group's store.
    release.wait(timeout)
    dist.destroy_process_group()


def _failure_report(name: str, failures: dict[int, str], results: Any, procs: list, returned: set[int],
                    grace: float = 3.0) -> str:
    """Collect the other ranks' failures for a moment, put the root cause first, and say what became
    of each rank that sent no traceback."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            # A rank flushes what it sent before it exits: once none that owes word runs, none comes.
            if all(r in failures or r in returned or p.exitcode is not None for r, p in enumerate(procs)):
                break
            continue
        if ok:
            returned.add(rank)
        else:
            failures[rank] = value
    # The root cause first: a traceback of its own, then a rank that died without one, then the
    # failures that follow from a dead peer, then the ranks that returned or still ran.
    lines = {}
    for r, proc in enumerate(procs):
        if r in failures:
            order = 2 if is_secondary(failures[r]) else 0  # one that follows from a dead peer
            lines[r] = (order, f"rank {r} of {name} failed:\n{failures[r]}")
        else:
            order = 3 if r in returned or proc.exitcode is None else 1
            lines[r] = (order, f"rank {r} of {name} {_fate(proc, r in returned)}")
    return "\n".join(text for _, text in sorted(lines.values(), key=lambda line: line[0]))


def _fate(proc: Any, returned: bool) -> str:
    """What became of a rank that sent no traceback, in words."""
    if returned:
        return "returned its result"
    code = proc.exitcode
    if code is None:
        return "was still running and had sent no traceback"
    if code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"died with exit code {code}"
    return f"{how} and sent no traceback"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
    start: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``start``: ``"spawn"`` or ``"forkserver"`` (default: ``ZKIT_RANKS_START``, else ``"spawn"``)."""
    ctx = _context(start)
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_ranks_once(ctx, fn, world_size, args, kwargs, timeout, threads_per_rank, env, free_port())
        except RanksFailed as exc:
            # Another process took the free port between our probe and the rendezvous store's
            # bind; nothing of fn ran yet, so starting over on a new port is safe.
            if "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3
#: ``spawn`` or ``forkserver``: how ranks start (see the module docstring)
START_ENV = "ZKIT_RANKS_START"


def _context(start: str | None = None):
    method = start or os.environ.get(START_ENV) or "spawn"
    if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        method = "spawn"  # not on this platform
    if method not in ("spawn", "forkserver"):
        where = "run_ranks(start=...)" if start else START_ENV
        raise ValueError(f"{where} must be 'spawn' or 'forkserver', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Only torch: it is what costs the start-up, and importing it starts no thread.
        ctx.set_forkserver_preload(["torch"])
    return ctx


def _run_ranks_once(ctx, fn, world_size, args, kwargs, timeout, threads_per_rank, env, port) -> list[Any]:
    results = ctx.Queue()
    release = ctx.Event()  # set once every rank has returned: then they may close the group
    child_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, tuple(args), dict(kwargs or {}), r, world_size, port, threads_per_rank, child_env, results,
                  release, timeout),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in out]
                raise RanksTimedOut(
                    f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f} s; "
                    f"ranks still running: {missing}"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a traceback that is on its way arrive first
                    if results.empty():
                        raise RanksFailed(_failure_report(fn.__name__, {}, results, procs, set(out))) from None
                continue
            if not ok:
                raise RanksFailed(_failure_report(fn.__name__, {rank: value}, results, procs, set(out)))
            out[rank] = pickle.loads(value)
        release.set()
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs Dynamo hands it and compiles each with the
    backend named ``inner``: a test's proof that a forward was compiled at all (``graphs > 0``) and
    not recompiled at every step."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner, self.graphs = inner, 0
        self.graph_modules: list[Any] = []  # the FX graphs, in the order Dynamo handed them over

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        import torch._dynamo

        self.graphs += 1
        self.graph_modules.append(gm)
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


class OpsOutsideCompiledGraphs(TorchDispatchMode):
    """``with OpsOutsideCompiledGraphs() as mode: f()`` lists in ``mode.ops`` the aten ops ``f``
    dispatched outside compiled graphs (about one kernel launch each on a GPU). Compiled graphs
    keep running compiled under it (``ignore_compile_internals``); under a plain dispatch mode
    Dynamo skips the frame and the call runs eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))



class CountingCommunicator(Communicator):
    """A third-party communicator for tests: delegates every collective to ``inner`` (torch's) and
    counts the calls by kind in ``calls``; ``built`` lists the process groups one was built for in
    this process (``None``: the default group). The byte counters are ``inner``'s: one count per wire."""

    built: list[Any] = []

    def __init__(self, inner: Communicator, group: Any = None) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner, self.group, self.calls = inner, group, Counter()
        CountingCommunicator.built.append(group)

    def __getattr__(self, name: str) -> Any:  # what torch's communicator has beyond the protocol
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

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


def counting_communicator_record(name: str = "counting") -> Any:
    """A communicator record (for ``zkit.Stack(communicator=...)``) whose factory wraps torch's
    communicator in a :class:`CountingCommunicator`, for every process group."""
    from zkit.core.plugin_manager import get_plugin_manager
    from zkit.core.records import CommunicatorRecord

    torch_record = get_plugin_manager().lookup("communicator", "torch")

    def factory(group: Any, config: Any) -> CountingCommunicator:
        return CountingCommunicator(torch_record.factory(group, config), group)

    return CommunicatorRecord(name=name, factory=factory, dist="tests")
