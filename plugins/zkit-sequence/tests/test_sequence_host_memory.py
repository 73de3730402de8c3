"""A sequence-parallel run on the CPU gives freed activations back to the system: a long
sequence's activations, not its model states, fill a rank's memory (contrib/bench/bench_sequence.py
--longest)."""
import sys

import pytest

import sequence_ranks as sr
from zkit.testing import run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
FREED = 64 * (4 << 20)


def test_sequence_parallelism_on_the_cpu_returns_freed_memory():
    out = run_ranks(sr.freed_bytes_returned, 2, args=(2,), env={"ZKIT_HOST_MALLOC": "auto"}, timeout=300)
    assert all(applied for applied, _ in out)
    assert all(r >= FREED * 3 // 4 for _, r in out), f"of {FREED >> 20} MiB freed, {[r >> 20 for _, r in out]} MiB came back"


@pytest.mark.parametrize("sp,choice", [(1, "auto"), (2, "keep")])
def test_without_sequence_parallelism_or_under_keep_glibc_is_left_alone(sp, choice):
    # whether the heap happens to give the blocks back then depends on where glibc put the small
    # tensors, so the policy itself is what is checked
    out = run_ranks(sr.freed_bytes_returned, 2, args=(sp,), env={"ZKIT_HOST_MALLOC": choice}, timeout=300)
    assert not any(applied for applied, _ in out)
