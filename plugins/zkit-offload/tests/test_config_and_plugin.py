"""Config sections, the plugin's records and zkit_configure, the host allocator."""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.core.plugin_manager import get_plugin_manager
from zkit_offload import HostAllocator, plugin
from zkit_offload.config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig


def test_deepspeed_defaults():
    o, p, a = OffloadOptimizerConfig(), OffloadParamConfig(), AioConfig()
    assert (o.device, o.nvme_path, o.buffer_count, o.pin_memory, o.fast_init, o.ratio) == ("none", None, 4, True, False, 1.0)
    assert (p.device, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == ("none", 5, 10**8, 10**9, True)
    assert (a.block_size, a.queue_depth, a.intra_op_parallelism, a.single_submit, a.overlap_events, a.use_gds) == (
        1048576, 8, 1, False, True, False)


@pytest.mark.parametrize("cls, data, message", [
    (OffloadOptimizerConfig, {"device": "cpu", "pin_memroy": True}, "unknown key 'pin_memroy' in zero_optimization.offload_optimizer; did you mean 'pin_memory'?"),
    (OffloadParamConfig, {"max_in_gpu": 1}, "unknown key 'max_in_gpu' in zero_optimization.offload_param; did you mean 'max_in_cpu'?"),
    (AioConfig, {"thread_count": 2, "intra_op_parallelism": 2}, "aio: 'thread_count' and 'intra_op_parallelism' are both given"),
    (AioConfig, {"thread_cnt": 2}, "unknown key 'thread_cnt' in aio; did you mean 'thread_count'?"),
    (OffloadOptimizerConfig, {"device": "nvme"}, "device 'nvme' needs nvme_path"),
    (OffloadOptimizerConfig, {"device": "disk"}, "'device' must be in ('none', 'cpu', 'nvme')"),
    (OffloadOptimizerConfig, {"ratio": 1.5}, "'ratio' must be <= 1.0"),
    (AioConfig, {"block_size": 0}, "'block_size' must be > 0"),
])
def test_bad_sections_are_refused(cls, data, message):
    with pytest.raises((ValueError, TypeError)) as info:
        cls.from_dict(data)
    assert message in str(info.value)


def test_aio_thread_count_is_intra_op_parallelism():
    assert AioConfig.from_dict({"thread_count": 3}).intra_op_parallelism == 3


def test_device_is_case_insensitive_and_frozen():
    c = OffloadOptimizerConfig.from_dict({"device": "CPU"})
    assert c.device == "cpu"
    with pytest.raises(Exception):
        c.device = "nvme"


def test_choose_stack():
    stack = plugin.choose_stack(OffloadOptimizerConfig(device="cpu"), AioConfig(), "AdamW")
    assert stack == zkit.Stack(allocator="host", optimizer="cpu_adamw")
    nvme = plugin.choose_stack(OffloadOptimizerConfig(device="nvme", nvme_path="/tmp"), AioConfig(), "Adam")
    assert (nvme.allocator, nvme.optimizer) == ("nvme", "cpu_adam")
    assert plugin.choose_stack(OffloadOptimizerConfig(), AioConfig(), "Adam") is None
    # any optimizer steps a host-resident master; only the fused CPU ones step sub-groups from NVMe
    assert plugin.choose_stack(OffloadOptimizerConfig(device="cpu"), AioConfig(), "SGD") == \
        zkit.Stack(allocator="host", optimizer=None)
    with pytest.raises(ValueError, match="optimizer 'SGD' cannot run with zero_optimization.offload_optimizer.device "
                                         "'nvme'.*or offload_optimizer.device 'cpu'"):
        plugin.choose_stack(OffloadOptimizerConfig(device="nvme", nvme_path="/tmp"), AioConfig(), "SGD")
    with pytest.raises(ValueError, match="GPUDirect Storage is not supported"):
        plugin.choose_stack(OffloadOptimizerConfig(device="cpu"), AioConfig(use_gds=True), "Adam")
    with pytest.raises(ValueError, match="partial optimizer offload is not supported"):
        plugin.choose_stack(OffloadOptimizerConfig(device="cpu", ratio=0.5), AioConfig(), "Adam")


def test_choose_stack_for_parameter_offload():
    cpu, nvme = OffloadParamConfig(device="cpu"), OffloadParamConfig(device="nvme", nvme_path="/tmp")
    # parameters alone: the allocator changes, the optimizer stays the configured one
    assert plugin.choose_stack(None, AioConfig(), "SGD", cpu, 3) == zkit.Stack(allocator="host", optimizer=None)
    assert plugin.choose_stack(None, AioConfig(), "Adam", nvme, 3).allocator == "nvme"
    both = plugin.choose_stack(OffloadOptimizerConfig(device="cpu"), AioConfig(), "Adam", nvme, 3)
    assert (both.allocator, both.optimizer) == ("nvme", "cpu_adam")
    with pytest.raises(ValueError) as info:
        plugin.choose_stack(OffloadOptimizerConfig(device="cpu"), AioConfig(), "Adam", cpu, 1)
    assert str(info.value).startswith("zero_optimization.offload_param (device 'cpu') needs ZeRO stage 3, the stage "
                                      "that partitions parameters; this config has stage 1.")


def test_host_allocator_with_parameters_only_keeps_optimizer_buffers_on_the_device():
    alloc = HostAllocator(torch.device("meta"), param=OffloadParamConfig(device="cpu"))
    assert [alloc.place(p).type for p in ("param", "master", "optim_state", "grad")] == ["cpu", "meta", "meta", "meta"]


def test_nvme_allocator_needs_an_nvme_section():
    from zkit_offload import NVMeAllocator

    with pytest.raises(ValueError) as info:
        NVMeAllocator(torch.device("cpu"), optimizer=OffloadOptimizerConfig(device="cpu"),
                      param=OffloadParamConfig(device="cpu"))
    assert str(info.value) == ("the 'nvme' allocator needs zero_optimization.offload_optimizer.device or "
                               "zero_optimization.offload_param.device 'nvme' (with an nvme_path)")


def test_records_are_registered():
    pm = get_plugin_manager(autoload=False, extra_plugins=[plugin])
    rec = pm.lookup("optimizer", "DeepSpeedCPUAdam")
    assert rec.name == "cpu_adam" and rec.state_names == ("exp_avg", "exp_avg_sq") and rec.devices == ("cpu",)
    assert pm.lookup("optimizer", "cpu_adagrad").state_names == ("sum",)
    assert pm.lookup("allocator", "nvme").name == "nvme"
    assert set(pm.config_sections()) >= {"zero_optimization.offload_optimizer", "zero_optimization.offload_param", "aio"}
    opt = rec.factory([{"params": [torch.nn.Parameter(torch.ones(2))]}], lr=0.1, adam_w_mode=True)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_host_allocator_places_optimizer_buffers_on_the_host():
    alloc = HostAllocator(torch.device("meta"), optimizer=OffloadOptimizerConfig(device="cpu"))
    assert [alloc.place(p).type for p in ("master", "master_grad", "optim_state", "param", "grad")] == [
        "cpu", "cpu", "cpu", "meta", "meta"]
    assert alloc.pin("master") and not alloc.pin("grad")
    buf = alloc.empty(10, torch.float32, "optim_state")
    assert buf.device.type == "cpu" and alloc.stats()["optim_state"]["live"] == 40
    with_param = HostAllocator(torch.device("meta"), param=OffloadParamConfig(device="cpu", pin_memory=False))
    assert with_param.place("param").type == "cpu" and not with_param.pin("param")
