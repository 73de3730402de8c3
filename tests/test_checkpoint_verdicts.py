"""Every rank reaches the same verdict on a checkpoint: a load refused on one rank (a damaged,
replaced, missing or swapped rank file) is refused on all, leaving every rank's state as it was;
a save failing on one rank (a refusal, a read-only or full file system, a file-size limit, a failed
rename on the first rank) fails on all, none waiting for the others, and the previous checkpoint
stays. Probes at 2 ranks, gloo."""
from __future__ import annotations

import pytest

from checkpoint_fault_ranks import LOAD_FAULTS, SAVE_FAULTS, load_faults, save_faults, save_into, small_tmpfs
from zkit.testing import run_ranks


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_load_refused_on_one_rank_is_refused_on_every_rank_with_no_state_changed(tmp_path, stage):
    # At stages 1-2 rank 0 reads only its own file: it used to load step 3 while rank 1 refused,
    # and a script falling back to step 2 trained on with the shards of two checkpoints.
    results = run_ranks(load_faults, world_size=2, args=(str(tmp_path), stage), timeout=240)
    step3 = tmp_path / "global_step3"
    for fault in LOAD_FAULTS:
        messages = {r[fault] for r in results}
        assert len(messages) == 1, (fault, messages)  # one verdict
        (message,) = messages
        if fault == "replaced by step 2's" and stage == 0:
            assert message == "loaded"  # rank 1's file holds only its RNG state, the same at both steps
            continue
        assert all(r[f"{fault}: state unchanged"] for r in results), (fault, message)
        if fault == "swapped with the other rank's":
            # each file read names itself (it used to be "covers 0 of the 4 elements" naming no file)
            for name in ("rank_00000.pt", "rank_00001.pt") if stage else ("rank_00000.pt",):
                assert f"{step3 / name}: holds other pieces than meta.msgpack lists for it" in message, message
            continue
        # the other faults are in rank 1's file, which at stages 1-2 only rank 1 reads
        expected = "checkpoint shard is missing" if fault == "deleted" else "tensor '"
        assert f"{step3 / 'rank_00001.pt'}: {expected}" in message, message
        if stage in (1, 2):
            assert message.startswith(f"loading checkpoint {step3} failed; rank 1: "), message
    # a DCP directory, rank 1's read failing
    assert results[0]["dcp"] == results[1]["dcp"] == (f"loading DCP checkpoint {tmp_path / 'dcp'} failed; rank 1: "
                                                      f"[Errno 5] Input/output error")
    assert all(r["dcp: state unchanged"] for r in results)
    assert [r["steps after falling back"] for r in results] == [3, 3]


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    # A refusal or a file-system error on the first rank (client_state, a read-only directory, the
    # metadata, the renames, latest) used to raise there alone: the other ranks waited in the
    # save's barrier until comms_timeout_s.
    results = run_ranks(save_faults, world_size=2, args=(str(tmp_path),), timeout=240)
    for fault, (rank, text) in SAVE_FAULTS.items():
        messages = {r[fault] for r in results}
        assert len(messages) == 1, (fault, messages)
        (message,) = messages
        assert f"failed; rank {rank}: " in message and text in message, (fault, message)
    for r in results:
        assert r["latest names"] == "t" and r["loaded steps"] == 1  # the previous checkpoint, intact
    assert not list(tmp_path.glob(".t*.old"))


@pytest.fixture
def mounted(tmp_path):
    """A 256 KiB tmpfs to save into (needs root; skipped otherwise), and a function remounting it read-only."""
    with small_tmpfs(tmp_path / "disk") as remount_read_only:
        yield tmp_path / "disk", remount_read_only


def test_a_read_only_file_system_fails_the_save_on_every_rank(mounted):
    mnt, remount_read_only = mounted
    remount_read_only()
    messages = run_ranks(save_into, world_size=2, args=(str(mnt),), timeout=120)
    assert messages[0] == messages[1]
    assert messages[0] == (f"saving checkpoint 't' failed; rank 0: {mnt}/.t.partial: creating the checkpoint's "
                           f"staging directory failed (Read-only file system)")


def test_a_full_file_system_fails_the_save_on_every_rank(mounted):
    mnt, _ = mounted
    messages = run_ranks(save_into, world_size=2, args=(str(mnt),), timeout=120)
    assert messages[0] == messages[1] and "no space left on device" in messages[0], messages
    assert not (mnt / "t").exists() and not (mnt / "latest").exists()
