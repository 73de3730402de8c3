"""What every rank started by ``zkit run`` runs first, then the user's script as ``__main__``.

* The rank dies with its launcher. torchrun starts ranks in sessions of their own, so killing the
  launcher (``kill -9``, an out-of-memory kill, a lost terminal) would leave them training and
  writing checkpoints; Linux's parent-death signal ends them instead.
* An uncaught exception, or ``sys.exit`` with a message or non-zero code, is recorded in
  torchrun's error file, so the job's summary (``zkit.rank_failures``) shows the failing rank's
  traceback.
* The process group is torn down in order when the script returns, so a finished job exits 0 (an
  abandoned gloo group aborts some exits with "terminate called without an active exception").

Usage (``zkit run`` builds this command line): ``torchrun ... -m zkit.rank_entry script.py args``.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys

LAUNCHER_PID = "ZKIT_LAUNCHER_PID"


def die_with_launcher() -> None:
    """Ask the kernel to kill this process when its parent (the launcher) dies; exit at once if
    the launcher is already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    expected = os.environ.get(LAUNCHER_PID)
    if expected and os.getppid() != int(expected):
        os._exit(1)  # the launcher died before the signal was armed


def tear_down_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m zkit.rank_entry SCRIPT [ARGS...]")
    die_with_launcher()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    @record
    def run_script() -> None:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # sys.exit(0) ends a script as well as returning does
            if exc.code not in (None, 0):
                # @record passes a SystemExit on unrecorded: record it, so the summary shows its message.
                ErrorHandler().record_exception(exc)
                raise
        tear_down_process_group()

    run_script()


if __name__ == "__main__":
    main()
