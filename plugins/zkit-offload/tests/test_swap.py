"""NVMe swapper, sub-group pipeline and the nvme allocator."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_offload import CPUAdam, NVMeAllocator, NVMeSwapper, SwapError
from zkit_offload.config import AioConfig, OffloadOptimizerConfig
from zkit_offload.pipeline import SubGroupBuffers, step_in_subgroups, subgroup_key
from zkit_offload.swap import aligned_empty


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def swapper(request, tmp_path):
    probe = NVMeSwapper(tmp_path)
    if request.param and not probe.direct:
        probe.close()
        pytest.skip("the test filesystem does not support O_DIRECT")
    probe.close()
    with NVMeSwapper(tmp_path, block_size=8192, io_threads=3, direct=request.param) as s:
        yield s


@settings(max_examples=15, deadline=None)
@given(n=st.sampled_from([0, 1, 3, 1023, 1024, 2049, 10_001]), aligned=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
def test_round_trip_is_exact(tmp_path_factory, n, aligned, dtype):
    for direct in (True, False):
        with NVMeSwapper(tmp_path_factory.mktemp("sw"), block_size=4096, io_threads=2, direct=None if direct else False) as s:
            src = aligned_empty(n, dtype) if aligned else torch.empty(n + 1, dtype=dtype)[1:]
            src.copy_((torch.rand(n) * 200).to(dtype))
            s.write("t", src)
            dst = torch.full((n,), 7, dtype=dtype) if not aligned else aligned_empty(n, dtype).fill_(7)
            s.read("t", dst)
            assert torch.equal(src, dst)
            assert s.bytes_written == s.bytes_read == src.numel() * src.element_size()


def test_async_many_keys(swapper):
    tensors = {f"k{i}": torch.randn(5000 + i) for i in range(6)}
    handles = [swapper.swap_out(k, t) for k, t in tensors.items()]
    for h in handles:
        h.wait()
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    for h in [swapper.swap_in(k, outs[k]) for k in tensors]:
        h.wait()
    assert all(torch.equal(outs[k], tensors[k]) for k in tensors)


def test_truncated_file_gives_the_documented_error(swapper):
    t = torch.randn(10_000)
    swapper.write("w", t)
    os.truncate(swapper.path("w"), 4096)
    with pytest.raises(SwapError, match=r"swap file '.*w\.swp' of 'w' is truncated: 4096 bytes, expected 40960"):
        swapper.read("w", torch.empty_like(t))


def test_failed_write_names_the_file_and_poisons_the_key(swapper, monkeypatch):
    t = torch.randn(4096)
    swapper.write("x", t)
    real = os.pwrite

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(SwapError, match=r"write of swap file '.*x\.swp' at offset 0 failed \(the disk is full\)"):
        swapper.write("x", t)
    monkeypatch.setattr(os, "pwrite", real)
    with pytest.raises(SwapError, match=r"cannot be read: its last write failed"):
        swapper.read("x", torch.empty_like(t))
    swapper.write("x", t)  # a successful write makes it readable again
    out = torch.empty_like(t)
    swapper.read("x", out)
    assert torch.equal(out, t)


def test_unusable_path_and_bad_sizes(tmp_path):
    with pytest.raises(SwapError, match="nvme_path '.*missing' is not an existing directory"):
        NVMeSwapper(tmp_path / "missing")
    with NVMeSwapper(tmp_path) as s:
        s.write("a", torch.zeros(10))
        with pytest.raises(ValueError, match="swap key 'a' holds 40 bytes; the tensor has 44"):
            s.read("a", torch.zeros(11))
        with pytest.raises(KeyError, match="swap key 'b' is not registered"):
            s.read("b", torch.zeros(10))
        with pytest.raises(ValueError, match="needs a contiguous CPU tensor"):
            s.write("a", torch.zeros(20)[::2])


def test_run_directory_removed_on_close_and_at_exit(tmp_path):
    s = NVMeSwapper(tmp_path)
    s.write("a", torch.ones(100))
    assert s.dir.exists()
    s.close()
    assert not s.dir.exists()
    code = ("import torch, sys; from zkit_offload import NVMeSwapper; "
            f"s = NVMeSwapper({str(tmp_path)!r}); s.write('a', torch.ones(10)); print(s.dir)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(out.stdout.strip())
    assert list(tmp_path.iterdir()) == []


_KEPT: list[NVMeSwapper] = []


def _swapper_left_open(root: str) -> None:
    _KEPT.append(NVMeSwapper(root))  # alive until the process ends, never closed
    _KEPT[-1].write("a", torch.ones(10))


def test_run_directory_removed_at_the_exit_of_a_forked_multiprocessing_child(tmp_path):
    """A forked child ends with os._exit, which skips atexit: multiprocessing's finalizers run."""
    import multiprocessing as mp

    child = mp.get_context("forkserver").Process(target=_swapper_left_open, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert list(tmp_path.iterdir()) == []


def test_run_directory_of_a_killed_process_removed_by_the_next_run(tmp_path):
    code = ("import os, sys, torch; from zkit_offload import NVMeSwapper; "
            f"s = NVMeSwapper({str(tmp_path)!r}); s.write('a', torch.ones(10)); print(s.dir, flush=True); "
            "os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    left = out.stdout.strip()
    assert os.path.exists(left)  # SIGKILL: no exit handler ran
    other_host = tmp_path / "zkit-swap-1-elsewhere"
    other_host.mkdir()
    (other_host / "owner").write_text("some-other-host 1\n")
    with NVMeSwapper(tmp_path) as live:
        assert live.removed_stale == [left]
        assert not os.path.exists(left)
        assert other_host.exists()  # another host's (shared filesystem): never touched
        with NVMeSwapper(tmp_path) as second:
            assert second.removed_stale == [] and live.dir.exists()  # a live process's: kept


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_pipeline_reads_steps_and_writes_every_subgroup(tmp_path, buffer_count):
    sizes = [{"a": 1000 + 17 * i, "b": 500} for i in range(5)]
    order = []
    with NVMeSwapper(tmp_path, block_size=4096) as s:
        buffers = SubGroupBuffers(sizes, buffer_count)

        def step(i, t):
            order.append(i)
            t["a"].add_(i + 1)
            t["b"].add_(1)

        step_in_subgroups(s, sizes, step, buffers, fresh=True)
        step_in_subgroups(s, sizes, step, buffers)
        assert order == [0, 1, 2, 3, 4] * 2
        for i, sg in enumerate(sizes):
            a = torch.empty(sg["a"])
            s.read(subgroup_key(i, "a"), a)
            assert torch.equal(a, torch.full_like(a, 2.0 * (i + 1)))


def test_nvme_allocator_steps_like_in_memory_adam(tmp_path):
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2)
    alloc = NVMeAllocator(torch.device("cpu"), optimizer=cfg, aio=AioConfig(queue_depth=2))
    gen = torch.Generator().manual_seed(0)
    shards = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (3000, 2000, 1001)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in shards]
    swapped, ref = CPUAdam(shards, lr=1e-2), CPUAdam(twins, lr=1e-2)
    for _ in range(3):
        for p, q in zip(shards, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        alloc.step_optimizer(swapped)
        ref.step()
    for p, q in zip(shards, twins):
        assert torch.equal(p, q)
    assert alloc.place("optim_state").type == "cpu" and alloc.place("param").type == "cpu"
    alloc.close()
    assert not alloc.swapper.dir.exists()


def test_full_disk_stops_the_first_step_before_it_changes_anything(tmp_path, monkeypatch):
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2)
    alloc = NVMeAllocator(torch.device("cpu"), optimizer=cfg, aio=AioConfig(queue_depth=2))
    alloc.sub_group_size = 2000
    shards = [torch.nn.Parameter(torch.ones(n)) for n in (1500, 1500, 1500)]
    for p in shards:
        p.grad = torch.ones(p.shape)
    real = os.posix_fallocate

    def fallocate(fd, offset, length):  # the disk fills up while the last sub-group's files are made
        if "sg2." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(SwapError, match=r"cannot allocate \d+ bytes for swap file '.*sg2\.exp_avg.*' \(the disk is full\)"):
        alloc.step_optimizer(CPUAdam(shards, lr=0.1))
    assert all(torch.equal(p, torch.ones(p.shape)) for p in shards)  # no sub-group stepped
    alloc.close()
