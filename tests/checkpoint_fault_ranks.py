"""Rank function for the checkpoint fault tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zkit
import zkit.checkpoint.save as save
from zkit.checkpoint import CheckpointError
from zkit.checkpoint.files import fs_error

import engine_ranks as er


@contextlib.contextmanager
def small_tmpfs(mnt: Path):
    """A 256 KiB tmpfs mounted at ``mnt`` (a save fills it), and a function remounting it
    read-only; the test is skipped where mounting needs root it does not have."""
    import pytest

    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def save_with_a_full_disk_on_rank_1(save_dir: str) -> str:
    """Rank 1's write fails as on a full disk: every rank's save raises, naming rank 1's file."""
    engine, *_ = zkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}})
    if engine.rank == 1:
        def full(obj, path: Path) -> None:
            raise fs_error(path, "writing the checkpoint", OSError(errno.ENOSPC, "No space left on device"))

        save.atomic_torch_save = full
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()
    return "saved"


# -- every rank the same verdict: a fault on one rank's side of a save or a load ----------------

#: each save fault: the rank it happens on, and the text every rank's error holds
SAVE_FAULTS = {
    "client_state": (0, "client_state must hold only tensors"),
    "read_only": (0, "/.t2.partial: creating the checkpoint's staging directory failed (Read-only file system)"),
    "full_disk": (1, "/.t2.partial/rank_00001.pt: no space left on device"),
    "file_size_limit": (1, "/.t2.partial/rank_00001.pt: writing the checkpoint failed (File too large)"),
    "plugin": (1, "the plugin's saved state is unavailable"),
    "metadata": (0, "/.t2.partial/meta.msgpack: writing the checkpoint failed (Input/output error)"),
    "rename": (0, "/t2: renaming the checkpoint into place failed (Input/output error)"),
    "latest": (0, "/latest: writing the checkpoint failed (Input/output error)"),
    "16bit_model": (0, "/model.pt: no space left on device"),
}


class _FailingPlugin:
    @zkit.hookimpl
    def zkit_checkpoint_save(self, engine):
        raise ValueError("the plugin's saved state is unavailable")


def _io_error(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")


@contextlib.contextmanager
def _save_fault(fault: str, engine, save_dir: str):
    """Make ``fault`` happen on this rank (the caller only enters it on the fault's rank)."""
    import zkit.checkpoint.commit as commit
    import zkit.checkpoint.sixteen_bit as sixteen_bit

    undo = contextlib.ExitStack()

    def patch(obj: Any, name: str, value: Any) -> None:
        undo.callback(setattr, obj, name, getattr(obj, name))
        setattr(obj, name, value)

    if fault == "read_only":
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if str(path).startswith(save_dir):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_mkdir(path, *args, **kwargs)

        patch(os, "mkdir", mkdir)
    elif fault == "full_disk":
        patch(save, "atomic_torch_save", _full)
    elif fault == "file_size_limit":  # a real write past RLIMIT_FSIZE: EFBIG (Python ignores SIGXFSZ)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        undo.callback(resource.setrlimit, resource.RLIMIT_FSIZE, (soft, hard))
    elif fault == "plugin":
        plugin = _FailingPlugin()
        engine.pm.register(plugin, name="failing-plugin")
        undo.callback(engine.pm.unregister, plugin)
    elif fault == "metadata":
        patch(save, "write_meta", _failing_write)
    elif fault == "rename":
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if str(src).endswith(".partial"):
                _io_error()
            return real_rename(src, dst, *args, **kwargs)

        patch(commit.os, "rename", rename)
    elif fault == "latest":
        patch(commit, "atomic_write_bytes", _failing_write)
    elif fault == "16bit_model":
        patch(sixteen_bit, "atomic_torch_save", _full)
    with undo:
        yield


def _full(obj: Any, path: Path) -> None:
    raise fs_error(path, "writing the checkpoint", OSError(errno.ENOSPC, "No space left on device"))


def _failing_write(path: Path, data: bytes) -> None:
    raise fs_error(path, "writing the checkpoint", OSError(errno.EIO, "Input/output error"))


def save_faults(save_dir: str) -> dict[str, Any]:
    """Save ``t``; then save ``t2`` (``t`` for the 16-bit model) with each fault on its rank. Every
    rank's save raises (its message, per fault); the ranks then train a step together (none waits
    in the save) and ``t`` still loads."""
    world = dist.get_world_size()
    engine = zkit.initialize(model=er.make_model(), config=er.config(1, "fp32", 1, world, comms_timeout_s=60))[0]
    er.train_engine(engine, 1, 1, world)
    engine.save_checkpoint(save_dir, tag="t")
    out: dict[str, Any] = {}
    for fault, (rank, _) in SAVE_FAULTS.items():
        fault_here = _save_fault(fault, engine, save_dir) if engine.rank == rank else contextlib.nullcontext()
        client_state = {"fn": object()} if fault == "client_state" and engine.rank == rank else {}
        try:
            with fault_here:
                if fault == "16bit_model":
                    engine.save_16bit_model(save_dir, "model.pt")
                else:
                    engine.save_checkpoint(save_dir, tag="t2", client_state=client_state)
            out[fault] = "saved"
        except CheckpointError as exc:
            out[fault] = str(exc)
        er.train_engine(engine, 1, 1, world, start=1)  # a collective: no rank is left in the save
    out["latest names"] = (Path(save_dir) / "latest").read_text()
    fresh = zkit.initialize(model=er.make_model(seed=1), config=er.config(1, "fp32", 1, world))[0]
    fresh.load_checkpoint(save_dir)
    out["loaded steps"] = fresh.global_steps
    engine.close()
    fresh.close()
    return out


def save_into(save_dir: str) -> str:
    """Save into ``save_dir`` (a read-only or a full file system); every rank's message, then a
    step together."""
    engine = zkit.initialize(model=torch.nn.Linear(256, 512), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}, "comms_timeout_s": 60})[0]
    try:
        engine.save_checkpoint(save_dir, tag="t")
        message = "saved"
    except CheckpointError as exc:
        message = str(exc)
    loss = engine(torch.ones(1, 256)).sum()
    engine.backward(loss)
    engine.step()
    engine.close()
    return message


#: each load fault, made to step 3's files: (rank file changed, what is done to it)
LOAD_FAULTS = ("replaced by step 2's", "one bit flipped", "deleted", "swapped with the other rank's")


def _damage(step3: Path, step2: Path, fault: str) -> None:
    one = step3 / "rank_00001.pt"
    if fault == "replaced by step 2's":
        shutil.copyfile(step2 / "rank_00001.pt", one)
    elif fault == "one bit flipped":
        # in a master weight (at stage 0 rank 1's file holds no pieces: in its RNG state)
        data = torch.load(one, weights_only=True)
        tensor = data["pieces"][0]["master"] if data["pieces"] else data["rng"]["torch"]
        raw = bytearray(one.read_bytes())
        at = raw.find(tensor.numpy().tobytes())
        assert at > 0
        raw[at + 2] ^= 0x10
        one.write_bytes(bytes(raw))
    elif fault == "deleted":
        one.unlink()
    else:
        zero = step3 / "rank_00000.pt"
        a, b = zero.read_bytes(), one.read_bytes()
        zero.write_bytes(b)
        one.write_bytes(a)


def _engine_state(engine) -> list[torch.Tensor]:
    out = [p.master.detach().cpu().clone() for p in engine.partitioner.pieces()]
    for state in engine.optimizer.state.values():
        out += [v.detach().cpu().clone() for v in state.values() if torch.is_tensor(v)]
    return out + [torch.tensor(engine.global_steps)]


def load_faults(save_dir: str, stage: int) -> dict[str, Any]:
    """Save steps 2 and 3; load step 3 with each fault made to one rank's file: every rank
    refuses (its message, per fault) and its state is unchanged; step 2 then loads, as a script
    falling back to it would."""
    world = dist.get_world_size()
    cfg = er.config(stage, "fp32", 1, world, comms_timeout_s=60)
    engine = zkit.initialize(model=er.make_model(), config=cfg)[0]
    er.train_engine(engine, 2, 1, world)
    engine.save_checkpoint(save_dir)
    er.train_engine(engine, 1, 1, world, start=2)
    engine.save_checkpoint(save_dir)
    engine.close()
    step2, step3 = Path(save_dir) / "global_step2", Path(save_dir) / "global_step3"
    pristine = {f.name: f.read_bytes() for f in step3.glob("rank_*.pt")}
    fresh = zkit.initialize(model=er.make_model(seed=1), config=cfg)[0]
    er.train_engine(fresh, 1, 1, world)  # optimizer state to keep
    out: dict[str, Any] = {}
    for fault in LOAD_FAULTS:
        if fresh.rank == 0:
            _damage(step3, step2, fault)
        dist.barrier()
        before = _engine_state(fresh)
        try:
            fresh.load_checkpoint(save_dir, tag="global_step3")
            out[fault] = "loaded"
        except CheckpointError as exc:
            out[fault] = str(exc)
        after = _engine_state(fresh)
        out[f"{fault}: state unchanged"] = len(before) == len(after) and all(map(torch.equal, before, after))
        dist.barrier()
        if fresh.rank == 0:
            for name, data in pristine.items():
                (step3 / name).write_bytes(data)
        dist.barrier()
    out["dcp"], out["dcp: state unchanged"] = _load_dcp_failing_on_rank_1(fresh, save_dir)
    fresh.load_checkpoint(save_dir, tag="global_step2")
    er.train_engine(fresh, 1, 1, world, start=2)
    out["steps after falling back"] = fresh.global_steps
    fresh.close()
    return out


def _load_dcp_failing_on_rank_1(engine, save_dir: str) -> tuple[str, bool]:
    """Step 3 exported as DCP, loaded with rank 1's read failing: the message and whether the state
    is unchanged."""
    import torch.distributed.checkpoint as dcp

    from zkit.checkpoint.dcp import write_dcp

    out = Path(save_dir) / "dcp"
    if engine.rank == 0:
        write_dcp(save_dir, out, tag="global_step3")
    dist.barrier()
    real = dcp.load
    if engine.rank == 1:
        dcp.load = _io_error
    before = _engine_state(engine)
    try:
        engine.load_checkpoint(str(out))
        message = "loaded"
    except CheckpointError as exc:
        message = str(exc)
    finally:
        dcp.load = real
    after = _engine_state(engine)
    return message, len(before) == len(after) and all(map(torch.equal, before, after))


def load_refused_deepspeed(path: str) -> dict[str, Any]:
    """Load a DeepSpeed ZeRO-2 checkpoint one of whose files is refused on one rank: its message,
    and whether the engine's state is unchanged."""
    from deepspeed_peer_model import PeerNet, ds_config

    engine = zkit.initialize(model=PeerNet(), config=ds_config(2, dist.get_world_size(), "fp32"))[0]
    before = _engine_state(engine)
    try:
        engine.load_checkpoint(path)
        message = "loaded"
    except CheckpointError as exc:
        message = str(exc)
    after = _engine_state(engine)
    engine.close()
    return {"message": message, "unchanged": len(before) == len(after) and all(map(torch.equal, before, after))}
