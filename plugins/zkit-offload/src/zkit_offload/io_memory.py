"""Host memory for direct I/O: aligned, and backed by huge pages where the kernel offers them.

Every buffer the NVMe swapper reads into or writes from (parameter store buffers, the optimizer
sub-group pipeline, staging, host buffers of the ``nvme`` allocator) comes from
:func:`aligned_empty`. Direct I/O needs the address aligned to the device block (4 KiB covers
512-byte and 4 KiB devices). Beyond that, *how the buffer's pages were placed* matters to the
disk: each request names its memory page by page, and a 1 MiB request into 4 KiB pages scattered
across physical memory is 256 pieces for the device (or the hypervisor under a virtual disk) to
gather. One file read as 16 MiB pieces into 12 reused buffers on the virtual disk this project's
figures come from (``contrib/bench/bench_nvme_swap.py --pages``, two runs): 2.34-2.59 GB/s into
huge pages, 1.80-2.04 GB/s into buffers torch wrote first on two threads (their pages interleave)
and 2.00-2.11 GB/s into buffers the reads touched first. Inside the 1218M-parameter NVMe step the
difference was larger: the step took 1.3-1.6x as long before its buffers moved to huge pages
(``docs/plugins/offload.md``, "I/O buffers on huge pages").

So a buffer of at least :data:`HUGE_FROM` bytes is mapped on its own, aligned to 2 MiB, with
``madvise(MADV_HUGEPAGE)``: each 2 MiB of it is then one physical piece. The kernel honours that
when transparent huge pages are ``always`` or ``madvise`` (the common defaults) and falls back to
4 KiB pages otherwise, or when no huge page is free; nothing is required of the machine. The
mapping is returned to the system when the tensor's storage is freed. Smaller buffers (and every
buffer where ``mmap.MADV_HUGEPAGE`` does not exist) come from torch's allocator as before.
"""
from __future__ import annotations

import mmap

import torch

#: Memory/offset/length alignment used for direct I/O (covers 512-byte and 4 KiB devices).
ALIGN = 4096
#: fp32 elements per :data:`ALIGN` block: where the NVMe master store starts every unit
ALIGN_ELEMS = ALIGN // 4
#: the huge page size asked for (x86-64 and arm64 with 4 KiB base pages)
HUGE_PAGE = 2 << 20
#: buffers from this size up get a mapping of their own on huge pages; below it, the rounding up
#: to whole huge pages would cost more than a quarter of the buffer
HUGE_FROM = 4 * HUGE_PAGE


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, align: int = ALIGN) -> torch.Tensor:
    """An uninitialised flat CPU tensor whose data starts on an ``align``-byte boundary, so the
    swapper can hand its memory to direct I/O without a staging copy; from :data:`HUGE_FROM`
    bytes up, on transparent huge pages (module docstring)."""
    nbytes = int(numel) * dtype.itemsize
    if nbytes >= HUGE_FROM and align <= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        return _huge_page_empty(nbytes).view(dtype)
    return small_page_empty(nbytes, align).view(dtype)


def small_page_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """``nbytes`` uninitialised bytes from torch's allocator (4 KiB pages wherever they fall),
    starting on an ``align``-byte boundary: :func:`aligned_empty` below :data:`HUGE_FROM`."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device="cpu")
    skip = (-raw.data_ptr()) % align
    return raw[skip: skip + nbytes]


def _huge_page_empty(nbytes: int) -> torch.Tensor:
    # One extra huge page of address space to align the start; never touched, so never resident.
    # private: an anonymous mapping is shared by default, and shared memory follows the shmem
    # huge page setting (usually ``never``) instead of the anonymous one
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still aligned
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the storage dies
    skip = (-raw.data_ptr()) % HUGE_PAGE
    return raw[skip: skip + nbytes]
