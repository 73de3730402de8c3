"""I/O buffers: aligned for direct I/O, large ones on huge pages of their own mapping."""
from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from zkit_offload.io_memory import ALIGN, HUGE_FROM, HUGE_PAGE, aligned_empty
from zkit_offload.swap import NVMeSwapper


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split("AnonHugePages:")[1].split()[0])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("nbytes", [0, 4, ALIGN + 8, HUGE_FROM - ALIGN, HUGE_FROM, HUGE_FROM + 3 * ALIGN])
def test_buffers_are_aligned_and_the_size_asked_for(nbytes, dtype):
    numel = nbytes // dtype.itemsize
    t = aligned_empty(numel, dtype)
    assert t.numel() == numel and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % ALIGN == 0
    if numel * dtype.itemsize >= HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE == 0  # its own mapping, aligned for huge pages
    t.fill_(3)
    assert int(t[-1:].sum() if numel else 0) == (3 if numel else 0)


def test_a_large_buffer_holds_its_mapping_until_its_last_view_dies(tmp_path):
    t = aligned_empty(HUGE_FROM // 4)
    view = t[100:200]
    del t
    gc.collect()
    view.fill_(5)  # still mapped: the view keeps the storage, the storage the mapping
    with NVMeSwapper(tmp_path, io_threads=2) as swapper:
        whole = aligned_empty(HUGE_FROM // 4).normal_()
        swapper.write("k", whole)
        back = aligned_empty(HUGE_FROM // 4)
        swapper.read("k", back)
        assert torch.equal(back, whole)
    assert torch.equal(view, torch.full((100,), 5.0))


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists() or not hasattr(mmap, "MADV_HUGEPAGE")
                    or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here (or not Linux): the buffers use 4 KiB pages")
def test_a_large_buffer_is_on_huge_pages_where_the_kernel_offers_them():
    before = _anon_huge_kib()
    t = aligned_empty(4 * HUGE_PAGE // 4).fill_(1)
    # the kernel may have no free huge page at this moment; on an idle machine it has
    after = _anon_huge_kib()
    assert after - before >= HUGE_PAGE // 1024, (before, after)
    del t
