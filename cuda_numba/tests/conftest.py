"""Kernel tests run under Numba's CUDA simulator on machines without a GPU.

The simulator must be chosen before numba is first imported; the repository's root conftest
sets ``NUMBA_ENABLE_CUDASIM=1`` when torch sees no CUDA device, and so does this file when the
directory runs alone.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def simulator_active() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@pytest.fixture
def sim():
    """Skip unless the kernels run under the simulator in this process."""
    if not simulator_active():
        pytest.skip("numba was imported before NUMBA_ENABLE_CUDASIM=1 was set, or a GPU is present")
