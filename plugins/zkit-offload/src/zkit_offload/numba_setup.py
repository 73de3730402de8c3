"""Process-wide Numba settings the CPU optimizers rely on, applied once before the kernels load.

* **JIT cache.** The kernels are compiled with ``cache=True`` so a new process loads them in a
  fraction of a second instead of compiling again. Numba stores the cache next to the module
  (``__pycache__``) or, when that is read-only (a system ``site-packages``), in the user cache
  directory. When neither is writable (read-only home in a container) Numba refuses to decorate a
  cached function; we then point it at a per-user directory under the system temp dir. An explicit
  ``NUMBA_CACHE_DIR`` always wins.
* **Threads.** Numba's pool defaults to every core of the machine, while each rank's torch runs
  on its own share (``OMP_NUM_THREADS``, which ``zkit run`` sets to cores / ranks). The pool is
  sized as torch's intra-op pool (:func:`configure_threads`), and torch's count is put back after
  the pool starts: starting, Numba's OpenMP pool sets the process's OpenMP thread count, which
  torch shares, so each of 2 ranks on 2 cores ran torch on both cores and the whole offloaded step
  took 0.86-1.14 s instead of 0.31 s (``contrib/bench/bench_offload_step.py``,
  docs/plugins/offload.md).
* **Threading layer.** Numba's ``workqueue`` layer aborts the whole process when two Python
  threads enter parallel code at once (a data-loader thread, an I/O pipeline callback). We ask for
  the ``threadsafe`` selection (OpenMP or TBB) unless the user chose a layer, and serialise kernel
  launches with a lock when only ``workqueue`` is available.
"""
from __future__ import annotations

import importlib
import os
import tempfile
import threading
from pathlib import Path

import numba

_HERE = Path(__file__).resolve().parent

#: Held around every parallel kernel launch when the threading layer is not thread-safe.
launch_lock = threading.Lock()


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def configure_cache() -> str:
    """Make sure Numba has a writable cache directory; return where the cache lives."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    if _writable(_HERE / "__pycache__"):
        return str(_HERE / "__pycache__")
    from numba.misc import appdirs

    user_dir = Path(appdirs.AppDirs(appname="numba", appauthor=False).user_cache_dir)
    if _writable(user_dir):
        return str(user_dir)
    fallback = Path(tempfile.gettempdir()) / f"zkit-numba-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fallback.mkdir(parents=True, exist_ok=True)
    numba.config.CACHE_DIR = str(fallback)
    return str(fallback)


def configure_threading() -> None:
    """Prefer a thread-safe threading layer (OpenMP, then TBB) unless the user picked one; keep
    Numba's default when neither library loads on this machine (launches are then serialised)."""
    if "NUMBA_THREADING_LAYER" in os.environ or numba.config.THREADING_LAYER != "default":
        return
    for layer in ("omp", "tbb"):
        try:
            importlib.import_module(f"numba.np.ufunc.{layer}pool")
        except ImportError:
            continue
        numba.config.THREADING_LAYER = layer
        return


def configure_threads() -> None:
    """Size Numba's thread pool (started at the first parallel kernel) as torch's intra-op pool,
    unless the user set ``NUMBA_NUM_THREADS``."""
    import torch

    if "NUMBA_NUM_THREADS" in os.environ:
        return
    threads = torch.get_num_threads()
    wanted = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    numba.config.NUMBA_NUM_THREADS = wanted  # the size the pool starts with
    numba.set_num_threads(wanted)  # starts it, or uses that many of its threads
    if torch.get_num_threads() != threads:  # starting, the OpenMP pool set the process's count
        torch.set_num_threads(threads)


def layer_is_threadsafe() -> bool:
    """Whether kernels may be launched from several Python threads at once (valid after the first
    launch; before it we assume not)."""
    try:
        return numba.threading_layer() in ("omp", "tbb")
    except ValueError:  # no parallel kernel has run yet
        return False


CACHE_DIR = configure_cache()
configure_threading()
configure_threads()
