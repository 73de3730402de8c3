"""What each rank started by the drop-in's ``deepspeed`` command runs: the user's script (or
``--module``) as ``__main__``, with ``--local_rank=N`` before its arguments as DeepSpeed's launcher
passes it (unless ``--no_local_rank``).

Usage (``deepspeed.launcher.runner`` builds it): ``zkit run ... user_script.py SCRIPT [ARGS...]``.
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: user_script.py SCRIPT [ARGS...] (started by the deepspeed command)")
    target, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("ZKIT_DEEPSPEED_LOCAL_RANK_ARG", "1") == "1":
        args = [f"--local_rank={os.environ['LOCAL_RANK']}", *args]
    if os.environ.get("ZKIT_DEEPSPEED_MODULE") == "1":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()  # as `python -m`
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
