"""Joining the process group. zkit never runs its own rendezvous: ranks come from torchrun's
environment (``zkit run`` is torchrun), or from a group the caller already initialised."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _record_uncaught_for_torchrun() -> None:
    """Under torchrun, write an uncaught exception to the agent's error file, so the job's summary
    names the failing rank and shows its traceback (what ``@record`` does, without decorating)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or getattr(sys, "_zkit_excepthook", False):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            # record_exception formats the exception being handled: outside an except block
            # (as in an excepthook) it would write "NoneType: None" instead of the traceback.
            try:
                raise exc.with_traceback(tb)
            except BaseException as raised:  # noqa: BLE001 - re-raised only to be formatted
                ErrorHandler().record_exception(raised)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
    sys._zkit_excepthook = True


def ensure_initialized(timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment variables when the caller
    has not done so. Without them (a plain ``python train.py``) the world is this one process."""
    _record_uncaught_for_torchrun()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    kwargs = {"timeout": timeout} if timeout else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(default_backend(), **kwargs)
    else:
        dist.init_process_group(
            default_backend(), store=dist.HashStore(), rank=0, world_size=1, **kwargs
        )
