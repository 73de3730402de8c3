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

ROOT = os.path.dirname(os.path.abspath(__file__))
# The real DeepSpeed's JIT-built CPU ops (tests/deepspeed_peer_ops.py builds them at set-up) live in
# the peer environment: in torch's per-user default directory, two checkouts' peer environments
# rebuild them over each other, minutes each time, whenever the other one has run.
if os.path.isdir(os.path.join(ROOT, ".venv-peers")):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv-peers", "torch_extensions"))

sys.path.insert(0, os.path.join(ROOT, "tests"))

pytest_plugins = ["background"]
