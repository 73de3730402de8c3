"""Offloaded training through the ZeRO stages matches training without offload.

Optimizer offload to the CPU (``host`` allocator, fused CPU AdamW) and to NVMe (``nvme`` allocator,
optimizer state in swap files between steps) at stages 1-3 in fp32, bf16 and fp16, on 2 gloo
ranks; checkpoints of offloaded runs resume on 2 ranks and reshard to 1.
"""
import pytest
import torch

from zkit.testing import run_ranks

import offload_ranks as orr

STAGES = (1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
TOLERANCE = orr.TOLERANCE
_max_diff = orr.max_diff


@pytest.fixture(scope="module")
def nvme_root(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def results(nvme_root):
    cases = [(s, d, dev) for s in STAGES for d in DTYPES for dev in ("none", "cpu")]
    cases += [(s, d, "nvme") for s in STAGES for d in DTYPES]
    return run_ranks(orr.training_matrix, 2, args=(cases, str(nvme_root)), timeout=300)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_offload_matches_no_offload(results, stage, dtype):
    for rank in results:
        base, off = rank[(stage, dtype, "none")], rank[(stage, dtype, "cpu")]
        assert off["allocator"] == "host" and off["optimizer"] == "CPUAdamW"
        assert base["allocator"] == "flat"
        assert _max_diff(off["params"], base["params"]) < TOLERANCE[dtype]
        assert off["losses"] == pytest.approx(base["losses"], rel=TOLERANCE[dtype])
        assert off["losses"][-1] < off["losses"][0]
    # both ranks end with the same parameters
    assert _max_diff(results[0][(stage, dtype, "cpu")]["params"], results[1][(stage, dtype, "cpu")]["params"]) == 0


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvme_offload_matches_no_offload(results, nvme_root, stage, dtype):
    for rank in results:
        base, off = rank[(stage, dtype, "none")], rank[(stage, dtype, "nvme")]
        assert off["allocator"] == "nvme"
        assert _max_diff(off["params"], base["params"]) < TOLERANCE[dtype]
        assert off["losses"] == pytest.approx(base["losses"], rel=TOLERANCE[dtype])
        # between steps the state is in the swap files: host memory keeps only the step counts
        assert off["state_type"] == "SwappedState" and off["resident_tensors"] == 0
        # two state tensors (exp_avg, exp_avg_sq) per sub-group, written from the first step on;
        # at stages 2-3 the fp32 master and its gradients are swapped with them
        files = off["swap_files"]
        assert len(files) == 3 and files[0] and all(f == files[0] for f in files)
        names = (".exp_avg.", ".exp_avg_sq.") + ((".master.", ".grad.") if stage >= 2 else ())
        per_name = [sum(n in f for f in files[0]) for n in names]
        assert per_name[0] > 0 and all(c == per_name[0] for c in per_name)
        assert sum(per_name) == len(files[0])
        if stage >= 2:  # no fp32 master or gradient shard in memory
            assert off["master_is_placeholder"] and off["grad_shards"] == 0
        assert not off["swap_dir_after_close"]
    assert list(nvme_root.iterdir()) == []  # every run directory removed by engine.close()


CHECKPOINT_CASES = [(2, "cpu"), (1, "nvme"), (3, "nvme")]


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    """Uninterrupted runs, resumed on 2 ranks, resumed (resharded) on 1 rank."""
    return orr.checkpoint_round_trips(tmp_path_factory, CHECKPOINT_CASES, "ckpt")


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_offloaded_checkpoint_resumes_and_reshards(checkpoint_runs, case):
    orr.check_resumes_and_reshards(checkpoint_runs, case)


def test_estimator_matches_nvme_offload_at_stages_2_and_3(tmp_path):
    for rank in run_ranks(orr.nvme_memory_vs_estimate, 2, args=(str(tmp_path),), timeout=120):
        for stage, r in rank.items():
            mem, device = r["memory"], r["device"]
            assert sum(r["nvme"].values()) == mem["optim_state_nvme_bytes"], stage
            assert device["master_grad"] == mem["master_grad_bytes"], stage
            assert device["optim_state"] == mem["optim_state_peak_bytes"], stage
            assert "grad" not in device and not mem.get("grad_bytes"), stage
            assert "master" not in device and not mem.get("master_bytes"), stage
