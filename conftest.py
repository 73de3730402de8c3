"""Test-wide set-up. The Numba CUDA simulator must be chosen before the first ``import numba``,
so it is chosen here, before any test module loads: on a machine without a CUDA device the
kernels of zkit-cuda-numba run in the simulator. ``run_ranks`` forks its ranks from a forkserver
that has imported torch once, instead of starting interpreters that each import it again: about
2 s saved per multi-rank test (see ``zkit.testing``)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ZKIT_RANKS_START", "forkserver")
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
