"""Master and gradients on NVMe (stages 2-3): swapper offsets, the store's layout, gradient
accumulation and norms, master round trips; training through the engine is in
test_offload_training.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_offload import NVMeAllocator, NVMeSwapper
from zkit_offload.config import OffloadOptimizerConfig
from zkit_offload.swap import ALIGN, aligned_empty
from zkit_offload.swapped_master import ALIGN_ELEMS, SwappedMasterStore


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def swapper(request, tmp_path):
    probe = NVMeSwapper(tmp_path)
    direct_ok = probe.direct
    probe.close()
    if request.param and not direct_ok:
        pytest.skip("the test filesystem does not support O_DIRECT")
    with NVMeSwapper(tmp_path, block_size=8192, io_threads=3, direct=request.param) as s:
        yield s


def test_offset_writes_touch_only_their_range(swapper):
    swapper.register("k", 3 * ALIGN)
    whole = torch.arange(3 * ALIGN // 4, dtype=torch.float32)
    swapper.write("k", whole)
    part = torch.full((ALIGN // 4,), -1.0)
    swapper.swap_out("k", part, ALIGN).wait()
    back = aligned_empty(whole.numel())
    swapper.read("k", back)
    expected = whole.clone()
    expected[ALIGN // 4 : ALIGN // 2] = -1.0
    assert torch.equal(back, expected)
    one = aligned_empty(ALIGN // 4)
    swapper.swap_in("k", one, 2 * ALIGN).wait()
    assert torch.equal(one, whole[ALIGN // 2 :])


def test_offset_errors_name_the_key_and_alignment(swapper):
    swapper.register("k", 2 * ALIGN)
    with pytest.raises(ValueError, match=r"swap key 'k' holds 8192 bytes; cannot access 4 bytes at offset 100 "
                                          r"\(offsets are multiples of 4096 inside the key\)"):
        swapper.swap_out("k", torch.zeros(1), 100)
    with pytest.raises(ValueError, match="cannot access 8192 bytes at offset 4096"):
        swapper.swap_in("k", torch.zeros(2048), ALIGN)


def _store(tmp_path, sizes, sub_group_size):
    alloc = NVMeAllocator(torch.device("cpu"), optimizer=OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path)))
    return alloc, SwappedMasterStore(alloc, sizes, sub_group_size)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), sub_group=st.integers(1, 5000))
def test_layout_aligns_units_and_fills_sub_groups(tmp_path_factory, sizes, sub_group):
    alloc, store = _store(tmp_path_factory.mktemp("nvme"), sizes, sub_group)
    try:
        for unit, (index, offset) in enumerate(store.unit_at):
            assert offset % ALIGN_ELEMS == 0
            assert offset + sizes[unit] <= store.sizes[index]
            assert unit in store.units_of[index]
        # units in order; a new sub-group only where the next unit would overflow a non-empty one
        flat = [u for units in store.units_of for u in units]
        assert flat == list(range(len(sizes)))
        for index in range(1, len(store.sizes)):
            first = store.units_of[index][0]
            assert store.sizes[index - 1] + -(-sizes[first] // ALIGN_ELEMS) * ALIGN_ELEMS > sub_group
    finally:
        alloc.close()


def test_gradients_accumulate_and_norm_follows(tmp_path):
    alloc, store = _store(tmp_path, [5, 3000, 7], 2048)
    try:
        g = [torch.randn(n) for n in (5, 3000, 7)]
        for unit, t in enumerate(g):
            store.add_grad(unit, t.to(torch.bfloat16))
        for unit, t in enumerate(g):  # a second micro-step adds
            store.add_grad(unit, t)
        expected = [t.to(torch.bfloat16).float() + t for t in g]
        assert store.grad_norm_sq() == pytest.approx(sum(float(e.square().sum()) for e in expected), rel=1e-5)
        store.flush()
        for unit, e in enumerate(expected):
            index, offset = store.unit_at[unit]
            back = aligned_empty(store.sizes[index])
            alloc.swapper.read(f"sg{index}.grad", back)
            assert torch.equal(back[offset : offset + e.numel()], e)
        store.zero_grad()
        assert store.grad_norm_sq() == 0
        store.add_grad(1, g[1])  # a new batch overwrites
        assert store.grad_norm_sq() == pytest.approx(float(g[1].square().sum()), rel=1e-5)
        store.add_grad(0, torch.tensor([float("inf"), 0, 0, 0, 0]))
        assert store.grad_norm_sq() == float("inf")
    finally:
        alloc.close()


def test_master_round_trip_and_size_error(tmp_path):
    alloc, store = _store(tmp_path, [10, 2000], 100)
    try:
        values = [torch.randn(10), torch.randn(2000)]
        for unit, v in enumerate(values):
            store.write_master(unit, v.to(torch.bfloat16))
        for unit, v in enumerate(values):
            assert torch.equal(store.read_master(unit), v.to(torch.bfloat16).float())
        with pytest.raises(ValueError, match="unit 0's master shard has 10 elements, got 11"):
            store.write_master(0, torch.zeros(11))
        assert store.nvme_bytes == sum(store.sizes) * 4 * 2  # master and gradients; no state before a step
    finally:
        alloc.close()
    assert not any(tmp_path.iterdir())
