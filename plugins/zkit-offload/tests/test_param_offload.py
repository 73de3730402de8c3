"""Stage-3 parameter offload (``offload_param`` cpu / nvme), with and without optimizer offload,
matches stage 3 without offload on 2 gloo ranks; the memory report separates NVMe bytes from
host memory; swap files are removed by ``engine.close()``; checkpoints of such runs resume and
reshard; misconfigurations are refused with a message naming the problem."""
import pytest

from zkit.testing import run_ranks

import offload_ranks as orr

#: (dtype, offload_optimizer device, offload_param device)
CASES = [(d, "none", p) for d in ("fp32", "bf16", "fp16") for p in ("none", "cpu", "nvme")]
CASES += [("fp32", "cpu", "cpu"), ("fp32", "cpu", "nvme"), ("fp32", "nvme", "nvme"), ("bf16", "nvme", "nvme")]
TOLERANCE = orr.TOLERANCE
_max_diff = orr.max_diff


@pytest.fixture(scope="module")
def nvme_root(tmp_path_factory):
    return tmp_path_factory.mktemp("param_nvme")


@pytest.fixture(scope="module")
def results(nvme_root):
    return run_ranks(orr.param_offload_matrix, 2, args=(CASES, str(nvme_root)), timeout=300)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "none"], ids="-".join)
def test_param_offload_matches_stage3_without_offload(results, case):
    dtype, opt, param = case
    for rank in results:
        base, off = rank[(dtype, "none", "none")], rank[case]
        assert off["allocator"] == ("nvme" if "nvme" in (opt, param) else "host")
        assert off["optimizer"] == ("CPUAdamW" if opt != "none" else base["optimizer"])
        assert _max_diff(off["params"], base["params"]) < TOLERANCE[dtype]
        assert off["losses"] == pytest.approx(base["losses"], rel=TOLERANCE[dtype])
        assert off["losses"][-1] < off["losses"][0]
        assert off["shard_devices"] in ([], ["cpu"])
        assert not any(off["dirs_after_close"])
    assert _max_diff(results[0][case]["params"], results[1][case]["params"]) == 0


def test_one_rank_nvme_params_match_stage3_without_offload(tmp_path):
    """With one rank a gather is a copy: stage 3 gathers ahead only shards whose read from NVMe
    has finished, and hands each store buffer back as soon as it is copied. Same training."""
    cases = [("fp32", "none", "none"), ("fp32", "none", "nvme"), ("fp32", "nvme", "nvme")]
    (rank,) = run_ranks(orr.param_offload_matrix, 1, args=(cases, str(tmp_path)), timeout=300)
    base = rank[cases[0]]
    for case in cases[1:]:
        assert {"mix", "embed"} <= set(rank[case]["stored_units"])  # read from NVMe at every gather
        assert _max_diff(rank[case]["params"], base["params"]) < TOLERANCE["fp32"]
        assert rank[case]["losses"] == pytest.approx(base["losses"], rel=TOLERANCE["fp32"])
    assert list(tmp_path.iterdir()) == []


def test_ds_tensor_of_a_shard_on_nvme_is_its_values_and_holds_no_buffer(tmp_path):
    """Reading DeepSpeed's ``ds_tensor`` of a stored shard hands the store's buffer back: a buffer
    held for ever would leave the gathers one buffer short, and with every buffer held they wait."""
    (out,) = run_ranks(orr.ds_tensor_of_stored_shards, 1, args=(str(tmp_path),), timeout=300)
    assert out["stored"] > 0 and out["match"], out
    assert out["buffers_held"] == [0, 0], out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nvme_params_swap_all_but_max_in_cpu(results, nvme_root, dtype):
    for rank in results:
        off = rank[(dtype, "none", "nvme")]
        # the LayerNorm's 6-element shard fits max_in_cpu; the Linear and the embedding are swapped
        assert off["stored_units"] == ["mix", "embed"]
        assert len(off["param_files"]) == 2
    assert list(nvme_root.iterdir()) == []


def test_memory_report_counts_nvme_bytes_apart(results):
    for rank in results:
        base = rank[("fp32", "none", "none")]["memory"]
        both = rank[("fp32", "nvme", "nvme")]["memory"]
        # shards of 21 and 39 fp32 elements per rank in swap files; m and v of the 4+35 owned... on disk
        assert both["param_nvme_bytes"] == (21 + 39) * 4
        assert both["optim_state_nvme_bytes"] > 0 and both["optim_state_bytes"] == 0
        assert "param_nvme_bytes" not in base and "optim_state_nvme_bytes" not in base
        # host bytes of parameters: 2 buffers of the largest swapped shard + the in-memory shard
        # (gathered full buffers released after the step)
        assert both["param_bytes"] == (2 * 39 + 6) * 4
        assert base["param_bytes"] == (39 + 21 + 6) * 4


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("param_errors"))
    zeros = [
        {"offload_param": {"buffer_size": 10}},
        {"offload_param": {"buffer_count": 0}},
        {"stage": 2},
    ]
    return run_ranks(orr.param_offload_errors, 2, args=(root, zeros), timeout=120)[0]


def test_buffer_too_small_names_both_sizes(errors):
    assert errors[0] == (
        "stage-3 module 'embed' has a parameter shard of 39 elements, more than "
        "zero_optimization.offload_param.buffer_size (10 elements); raise buffer_size to at least 39"
    )


def test_buffer_count_zero_refused(errors):
    assert "offload_param.buffer_count must be at least 1 with device 'nvme'" in errors[1]


def test_param_offload_needs_stage_3(errors):
    assert errors[2] == (
        "zero_optimization.offload_param (device 'nvme') needs ZeRO stage 3, the stage that partitions parameters; "
        "this config has stage 2. Set zero_optimization.stage to 3, or use offload_optimizer to offload optimizer "
        "state at stages 1-2"
    )


CHECKPOINT_CASES = [(3, "none", "cpu"), (3, "none", "nvme"), (3, "nvme", "nvme")]


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    """Uninterrupted runs, resumed on 2 ranks, resumed (resharded) on 1 rank."""
    return orr.checkpoint_round_trips(tmp_path_factory, CHECKPOINT_CASES, "param_ckpt")


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_param_offloaded_checkpoint_resumes_and_reshards(checkpoint_runs, case):
    orr.check_resumes_and_reshards(checkpoint_runs, case)


def test_model_built_under_init_goes_straight_to_nvme(tmp_path):
    """``zkit.zero.Init(config=...)`` with ``offload_param`` on NVMe: shards leave host memory
    as each module is built (only the ``max_in_cpu`` one stays), and training matches."""
    for out in run_ranks(orr.built_into_nvme, 2, args=(str(tmp_path),), timeout=180):
        assert out["in_memory_at_build"] == [orr.PARAM_NVME["max_in_cpu"]]  # the LayerNorm's shard
        assert out["built_by"] == ["NVMeAllocator"]  # the config's allocator placed the shards
        assert out["stored"] == ["embed", "mix"]
        assert out["diff"] < orr.TOLERANCE["fp32"]
        assert out["losses"] == pytest.approx(out["base"], rel=orr.TOLERANCE["fp32"])
    assert list(tmp_path.iterdir()) == []


def test_model_built_under_init_with_host_parameters_uses_the_configs_allocator():
    """``offload_param: cpu``: Init places each shard with the config's allocator (host memory
    next to a GPU), not on the training device, and training matches."""
    for out in run_ranks(orr.built_with_host_params, 2, timeout=180):
        assert out["built_by"] == ["HostAllocator"]
        assert out["diff"] < orr.TOLERANCE["fp32"]
        assert out["losses"] == pytest.approx(out["base"], rel=orr.TOLERANCE["fp32"])
