"""Every kernel compiles to PTX for sm_80 and sm_90 (catches typing errors the simulator cannot).

Needs numba-cuda's NVVM (``pip install "numba-cuda[cu13]"``); runs in a subprocess because this
process may use the simulator.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    from numba import cuda, float32, int32, int64, boolean, types
    float16 = types.float16
    CC = tuple(int(x) for x in sys.argv[1].split("."))
    try:
        cuda.compile_ptx(lambda a: None, (float32[:],), cc=CC)
    except Exception as exc:
        print("NO-NVVM", type(exc).__name__, exc)
        sys.exit(0)
    from zkit_cuda_numba import adam_kernels as A, block_sparse_kernels as K
    a3, a4, i1 = float32[:, :, ::1], float32[:, :, :, ::1], int32[::1]
    for dense in (float32[:, :, ::1], float16[:, :, ::1]):
        cuda.compile_ptx(K.sdd.py_func, (dense, dense, a4, i1, i1, i1, int64, int64, int64), cc=CC)
        cuda.compile_ptx(K.dsd.py_func, (a4, dense, a3, i1, i1, i1, boolean, int64, int64, int64), cc=CC)
    m2 = float32[:, ::1]
    cuda.compile_ptx(K.softmax_fwd.py_func, (a4, m2, i1, i1, int64, int64, float32, m2, m2, int64,
                                             boolean, boolean, boolean), cc=CC)
    cuda.compile_ptx(K.softmax_bwd.py_func, (a4, a4, i1, int64, float32), cc=CC)
    f1 = float32[::1]
    for grad in (float32[::1], float16[::1]):
        cuda.compile_ptx(A.check_finite.py_func, (grad, int64[::1], int64[::1], int32[::1]), cc=CC)
        cuda.compile_ptx(A.adam_step.py_func, (f1, grad, f1, f1, float16[::1], boolean, int64[::1],
                         int64[::1], i1, f1, f1, f1, f1, f1, f1, f1, boolean, float32, int32[::1]),
                         cc=CC)
    print("PTX-OK")
""")


@pytest.mark.parametrize("cc", ["8.0", "9.0"], ids=["sm_80", "sm_90"])
def test_kernels_compile_to_ptx(cc):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, cc], env=env, capture_output=True, text=True,
                          timeout=300)
    if "NO-NVVM" in proc.stdout:
        pytest.skip(f"numba-cuda has no NVVM here (install numba-cuda[cu13]): {proc.stdout.strip()}")
    assert proc.returncode == 0 and "PTX-OK" in proc.stdout, proc.stdout + proc.stderr
