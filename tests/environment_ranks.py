"""Rank functions of tests/test_testing.py: they import nothing heavy, so that a spawned rank starts as
fast as it can."""
import os
import signal


def getenvs(*names: str) -> list[str | None]:
    """The values of ``names`` in this rank's environment (``None``: not set)."""
    return [os.getenv(name) for name in names]


def rank_one_dies(how: str) -> int:
    """Rank 1 ends its process without a word (``"SIGKILL"``: by that signal; ``"exit 3"``: with
    that exit code); the other ranks return their rank at once."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(int(how.split()[1]))
    return dist.get_rank()


def last_rank_uses_the_group_after_the_others_returned() -> int:
    """The other ranks return at once; the last one, once rank 0 is gone or a few seconds on, still
    reaches rank 0's store. A rank that closed its end of the group as soon as it returned would
    fail it here, as it fails a slower rank that gloo is still connecting to it."""
    import time

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store, rank, last = _get_default_store(), dist.get_rank(), dist.get_world_size() - 1
    if rank != last:
        store.set(f"pid {rank}", str(os.getpid()))
        store.add("returned", 1)
        return rank
    while store.add("returned", 0) < last:
        time.sleep(0.05)
    rank_0 = int(store.get("pid 0"))
    for _ in range(60):
        if not _running(rank_0):
            break
        time.sleep(0.05)
    store.set("still there", "yes")
    return rank


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has closed its sockets
    except FileNotFoundError:
        return False
