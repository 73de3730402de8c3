"""A finished job exits 0: ``engine.close()`` destroys the process group the engine created and
joins its threads, so none is alive when the interpreter exits.

Before, ``close()`` unregistered the group but the communicator kept the last reference to it, so
its gloo threads lived on into the interpreter's exit. A worker thread that then dropped the last
reference to a finished collective's tensor needed the interpreter's lock, and a finalizing
interpreter ends such a thread from inside a C++ destructor: "terminate called without an active
exception", SIGABRT, and ``zkit run`` exiting 1 after the script had finished."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import zkit
from zkit.testing import run_ranks

#: the native threads of a gloo process group, as the kernel names them
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _gloo_threads() -> int:
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sum(name in GLOO_THREADS for name in names)


def train_one_step_and_close() -> list[tuple[int, int, int, str]]:
    """Rank function: at every ZeRO stage, an engine takes one step and closes; the gloo threads
    before the engine, with it, after ``close()``, and what a collective after ``close()`` says."""
    torch.distributed.barrier()  # the default group's worker threads start with its first collective
    out = []
    for stage in range(4):
        before = _gloo_threads()
        torch.manual_seed(0)
        engine, *_ = zkit.initialize(model=torch.nn.Linear(8, 2), config={
            "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage}})
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
        during = _gloo_threads()
        engine.close()
        try:
            engine.comm.barrier()
            after_close = "no error"
        except ValueError as exc:
            after_close = f"{exc}"
        out.append((before, during, _gloo_threads(), after_close))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_close_joins_the_threads_of_the_process_group_it_created():
    for rank in run_ranks(train_one_step_and_close, 2, timeout=300):
        for stage, (before, during, after, message) in enumerate(rank):
            assert during > before, (stage, before, during)  # the engine's own group (comms_timeout_s)
            assert after == before, f"stage {stage}: {after - before} gloo thread(s) left after close()"
            assert message == ("this communicator was closed (engine.close() destroyed its process group): "
                               "build a new engine to train on"), message
