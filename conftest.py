"""Test-wide set-up. The Numba CUDA simulator must be chosen before the first ``import numba``,
so it is chosen here, before any test module loads: on a machine without a CUDA device the
kernels of zkit-cuda-numba run in the simulator. ``run_ranks`` forks its ranks from a forkserver,
started here, that has imported torch, torch's compiler front end and zkit's plugins once
(``tests/rank_preload.py``), instead of starting interpreters that each import them again: a
multi-rank test's launch takes a fraction of a second instead of 2-5 s (see ``zkit.testing``).

Long runs that a module's fixtures wait for (the real DeepSpeed's reference runs, the Hugging Face
and Lightning flows, the composition matrix, the benchmark's smoke run) start in processes of their
own when the session starts, and those modules run last (``tests/background.py``): most tests run
in this one process and leave the second core idle, which those runs use meanwhile."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ZKIT_RANKS_START", "forkserver")
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

ROOT = os.path.dirname(os.path.abspath(__file__))
# The real DeepSpeed's JIT-built CPU ops (tests/deepspeed_peer_ops.py builds them at set-up) live in
# the peer environment: in torch's per-user default directory, two checkouts' peer environments
# rebuild them over each other, minutes each time, whenever the other one has run.
if os.path.isdir(os.path.join(ROOT, ".venv-peers")):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv-peers", "torch_extensions"))

sys.path.insert(0, os.path.join(ROOT, "tests"))


def _start_rank_forkserver() -> None:
    """Start the ranks' forkserver now, with what each rank would otherwise import in every test
    (``tests/rank_preload.py``): it imports on the second core while this process collects. Once it
    runs, zkit.testing's own preload list (torch only) no longer applies. Ranks that start this fast
    once showed gloo's "Connection closed by peer" while connecting: a rank that had returned closed
    the group under a slower one, with any preload; ``run_ranks`` now keeps the group open until
    every rank has returned."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "rank_preload"])
    # The forkserver is a new interpreter that does not take this process's sys.path: it finds
    # tests/ on PYTHONPATH. Its ranks get the caller's environment, not this variable.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), before) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


if os.environ["ZKIT_RANKS_START"] == "forkserver":
    _start_rank_forkserver()

pytest_plugins = ["background"]
