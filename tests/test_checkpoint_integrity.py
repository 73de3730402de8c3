"""Damaged checkpoints are refused, never trained on: every tensor carries a checksum that loading
and ``zkit consolidate`` verify; a ``latest`` leading outside the directory, a full disk and the
staging of a save that died are handled with a message naming the file."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zkit
from zkit.checkpoint import CheckpointError
from zkit.checkpoint.consolidate import consolidate
import zkit.checkpoint.digest as digest_mod
from zkit.checkpoint.digest import Digest, payload_digests, tensor_digest

import engine_ranks as er


def _engine(stage=2):
    return zkit.initialize(model=er.make_model(), config=er.config(stage, "fp32", 1, 1))[0]


def _saved(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    engine = _engine()
    er.train_engine(engine, 1, 1, 1)
    engine.save_checkpoint(str(tmp_path), tag="t")
    shard = tmp_path / "t" / "rank_00000.pt"
    data = torch.load(shard, weights_only=True)
    return shard, data["pieces"][0]["master"]


def _offset_of(shard: Path, tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes are stored inside the rank file."""
    raw = shard.read_bytes()
    offset = raw.find(tensor.numpy().tobytes())
    assert offset > 0
    return offset


_NO_NUMBA = importlib.util.find_spec("numba") is None
_SUMS = ["numpy", pytest.param("kernel", marks=pytest.mark.skipif(_NO_NUMBA, reason="Numba is not installed"))]


def _sum_with(monkeypatch, sums: str) -> None:
    """Digest with numpy, or with the Numba kernel down to the smallest tensor (fused into the copy)."""
    monkeypatch.setattr(digest_mod, "_pick", (lambda words: None) if sums == "numpy" else _kernel_always)


def _kernel_always(words: int):
    from zkit.checkpoint.digest_kernel import kernel

    return kernel()


@pytest.mark.parametrize("sums", _SUMS)
@pytest.mark.parametrize("damage", ["block_of_ff", "flipped_bytes"])
def test_damaged_tensor_bytes_are_refused_at_load_and_consolidate(tmp_path, damage, sums, monkeypatch):
    _sum_with(monkeypatch, sums)
    shard, master = _saved(tmp_path)
    raw = bytearray(shard.read_bytes())
    start = _offset_of(shard, master)
    size = master.numel() * 4
    if damage == "block_of_ff":
        raw[start : start + min(4096, size)] = b"\xff" * min(4096, size)
    else:
        for i in range(64):  # 64 bytes flipped, spread over the tensor
            raw[start + (i * 37) % size] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: tensor 'pieces/0/master' is damaged"):
        _engine().load_checkpoint(str(tmp_path), tag="t")
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: tensor 'pieces/0/master' is damaged"):
        consolidate(tmp_path, out, tag="t")
    assert not out.exists()


@pytest.mark.parametrize("sums", _SUMS)
def test_an_undamaged_checkpoint_loads_and_consolidates(tmp_path, sums, monkeypatch):
    _sum_with(monkeypatch, sums)
    _, master = _saved(tmp_path)
    engine = _engine()
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(engine.partitioner.pieces()[0].master.reshape(-1), master)
    consolidate(tmp_path, tmp_path / "model.pt", tag="t")


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]


@pytest.mark.skipif(_NO_NUMBA, reason="Numba is not installed")
@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), n=st.integers(0, 700), src_at=st.integers(0, 9), dst_at=st.integers(0, 9),
       fed=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_the_kernel_digest_fused_into_a_copy_equals_the_reference(dtype, n, src_at, dst_at, fed, seed):
    # The kernel (summing alone or while copying) against numpy's sums, for any dtype, length,
    # offset of either tensor in its buffer, and number of bytes fed to the digest before.
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    src = torch.randint(0, 256, ((src_at + n) * width,), dtype=torch.uint8, generator=g).view(dtype)[src_at:]
    before = torch.randint(0, 256, (fed,), dtype=torch.uint8, generator=g)
    buf = torch.zeros(dst_at + n + 3, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digest_mod, "_pick", lambda words: None)
        reference = Digest().update(before).update(src).hexdigest()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digest_mod, "_pick", _kernel_always)
        summed = Digest().update(before).update(src).hexdigest()
        copied = Digest().update(before).update_copying(src, buf[dst_at : dst_at + n]).hexdigest()
    assert summed == reference and copied == reference
    raw = buf.view(torch.uint8)
    assert torch.equal(raw[dst_at * width : (dst_at + n) * width], src.view(torch.uint8))
    assert not raw[: dst_at * width].any() and not raw[(dst_at + n) * width :].any()  # nothing written outside


def test_latest_leading_outside_the_directory_is_refused(tmp_path):
    _saved(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt" / "t", tmp_path / "elsewhere")
    for target in ("../elsewhere", "/etc", "t/../../elsewhere"):
        (tmp_path / "ckpt" / "latest").write_text(target)
        with pytest.raises(CheckpointError, match=f"names tag '{target}', which is not a checkpoint directory inside"):
            _engine().load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="tag '../elsewhere' is not a checkpoint directory inside"):
        _engine().load_checkpoint(str(tmp_path / "ckpt"), tag="../elsewhere")


def test_stale_staging_of_a_dead_save_is_removed_at_the_next_save(tmp_path):
    stale = tmp_path / ".global_step7.partial"
    stale.mkdir()
    (stale / "rank_00000.pt").write_bytes(b"x" * 1000)
    _engine().save_checkpoint(str(tmp_path), tag="t")
    assert not stale.exists()
    assert (tmp_path / "t" / "meta.msgpack").is_file()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs: a save fills it (needs root; skipped otherwise)."""
    from checkpoint_fault_ranks import small_tmpfs

    with small_tmpfs(tmp_path / "disk"):
        yield tmp_path / "disk"


def test_a_full_disk_says_so_naming_the_file(tiny_disk):
    engine = zkit.initialize(model=torch.nn.Linear(256, 512), config=er.config(0, "fp32", 1, 1))[0]
    with pytest.raises(CheckpointError, match=r"disk/\.t\.partial/rank_00000\.pt: no space left on device"):
        engine.save_checkpoint(str(tiny_disk), tag="t")


def test_digest_is_the_same_fed_in_parts_and_sees_swaps():
    t = torch.randn(10_001)
    whole = tensor_digest(t)
    raw = t.view(torch.uint8)
    parts = Digest()
    for lo in range(0, raw.numel(), 4099):
        parts.update(raw[lo : lo + 4099])
    assert parts.hexdigest() == whole
    swapped = t.clone()
    words = swapped[:10_000].view(torch.int64)
    words[[3, 4]] = words[[4, 3]]
    assert tensor_digest(swapped) != whole
    assert set(payload_digests({"a": [t, {"b": t}], "n": 3})) == {"a/0", "a/1/b"}


def test_digest_is_the_same_on_any_thread_count(monkeypatch):
    import zkit.checkpoint.digest as digest

    t = torch.randn(3 * 65536 + 77)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_digest(t)
        monkeypatch.setattr(digest, "_SLAB_MIN", 1000)  # slabs of whole chunks on three threads
        torch.set_num_threads(3)
        assert tensor_digest(t) == one
    finally:
        torch.set_num_threads(threads)


def test_a_rank_whose_write_fails_fails_the_save_on_every_rank(tmp_path):
    from checkpoint_fault_ranks import save_with_a_full_disk_on_rank_1
    from zkit.testing import run_ranks

    messages = run_ranks(save_with_a_full_disk_on_rank_1, world_size=2, args=(str(tmp_path),), timeout=120)
    for message in messages:  # no rank waits for rank 1's file
        assert message.startswith("saving checkpoint 't' failed; rank 1: ")
        assert "/.t.partial/rank_00001.pt: no space left on device" in message
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()


def test_checkpoint_files_get_the_mode_open_would_give_them(tmp_path):
    """Files are written through mkstemp, which makes them owner-only: a checkpoint shared with a
    group (or read by a job running as another user) would be unreadable."""
    import os

    umask = os.umask(0o022)
    os.umask(umask)
    _saved(tmp_path)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written
    for path in written:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
