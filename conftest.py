"""Test-wide set-up. The Numba CUDA simulator must be chosen before the first ``import numba``,
so it is chosen here, before any test module loads: on a machine without a CUDA device the
kernels of zkit-cuda-numba run in the simulator. ``run_ranks`` forks its ranks from a forkserver
that has imported torch once, instead of starting interpreters that each import it again: about
2 s saved per multi-rank test (see ``zkit.testing``).

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))

pytest_plugins = ["background"]
