"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's calls, DeepSpeed's enums):
training after offload/reload round trips equals training without them, bit for bit, at stages
1-3 and with CPU offload on; the states' storages really are emptied (their bytes held by the
offload copies), and the engine refuses to run while they are."""
from __future__ import annotations

import pytest
import torch

import zkit
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from zkit.testing import run_ranks

import offload_states_ranks as osr

ALL = [k.value for k in OffloadStateTypeEnum]


@pytest.mark.parametrize("stage, dtype, offload_optimizer", [
    (1, "fp32", False), (2, "bf16", False), (3, "bf16", False), (2, "fp32", True), (3, "fp32", True),
])
def test_round_trips_leave_training_unchanged(stage, dtype, offload_optimizer):
    results = run_ranks(osr.with_and_without, 2, args=(stage, dtype, offload_optimizer, None), timeout=300)
    for rank, both in enumerate(results):
        assert both["moved"]["losses"] == both["plain"]["losses"], rank
        out = both["moved"]
        assert out["refused"].startswith("engine.forward while the engine's states are offloaded")
        assert "call engine.reload_states() first" in out["refused"]
        assert out["host_bytes_equal"] and out["second_call_same"] and out["after_reload"] == 0
        assert out["param_emptied"]  # the model's parameters (or stage 3's shards) left the device
        shard = out["shard_elements"]
        if offload_optimizer:  # the master and optimizer state are on the host already: not moved (DeepSpeed's rule)
            assert out["bytes"]["optim_states"] == out["bytes"]["hp_params"] == 0
            kept = {"optim_states", "hp_params"} | ({"lp_grads"} if stage == 3 else set())  # stage 3: grads on the host
            assert out["kinds"] == sorted(set(ALL) - kept)
        else:
            assert out["state_emptied"] and out["state_restored"]
            assert out["bytes"]["optim_states"] >= 2 * 4 * shard  # Adam's two moments of this rank's shard
            assert out["kinds"] == sorted(ALL)
        if dtype == "bf16" and not offload_optimizer:
            assert out["bytes"]["hp_params"] >= 4 * shard  # a separate fp32 master
        # in fp32 the master is the parameters' own buffer at stages 1-2: those bytes are counted once, as hp_params
        assert out["bytes"]["lp_params"] + out["bytes"]["hp_params"] >= 4 * shard


def test_include_moves_only_the_kinds_named():
    out = run_ranks(osr.train, 1, args=(2, "fp32", False, True, [OffloadStateTypeEnum.optim_states]), timeout=300)[0]
    assert out["kinds"] == ["optim_states"] and out["state_emptied"] and not out["param_emptied"]
    assert out["bytes"]["lp_params"] == out["bytes"]["hp_params"] == 0


def _engine(**zero):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = zkit.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, **zero}})
    return engine


def test_bad_arguments_say_what_is_wrong(caplog):
    engine = _engine()
    with pytest.raises(ValueError, match="offload_states\\(device='nvme'\\) is not supported: states are offloaded "
                                         "to cpu memory only"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="offload_states\\(include=...\\): 'optimizer' is not a state type; valid: "
                                         "optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer"):
        engine.offload_states(include=["optimizer"])
    with pytest.raises(ValueError, match="'gpu' is not one of none, cpu, nvme"):
        engine.offload_states(device="gpu")
    engine.offload_states(device=OffloadDeviceEnum.none)
    assert engine.partitioner.offloaded_states() == []
    engine.offload_states()
    with pytest.raises(RuntimeError, match="engine.step while the engine's states are offloaded"):
        engine.step()
    with pytest.raises(RuntimeError, match="engine.save_checkpoint while"):
        engine.save_checkpoint("/nonexistent")
    engine.reload_states()
    engine.reload_states()  # nothing offloaded: nothing to do


def test_offloaded_parameters_and_no_optimizer_are_refused():
    engine = _engine(stage=3, offload_param={"device": "cpu"})
    with pytest.raises(ValueError, match="cannot move states of an engine whose parameters are offloaded"):
        engine.offload_states()
    model = torch.nn.Linear(4, 2)
    bare, *_ = zkit.initialize(model=model, config={"train_batch_size": 2})
    with pytest.raises(ValueError, match="offload_states\\(\\) needs an engine with an optimizer"):
        bare.offload_states()
