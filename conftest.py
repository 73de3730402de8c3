"""Test-wide set-up. The Numba CUDA simulator must be chosen before the first ``import numba``,
so it is chosen here, before any test module loads: on a machine without a CUDA device the
kernels of zkit-cuda-numba run in the simulator."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
