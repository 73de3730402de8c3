"""The allocator's typed store methods: ``None`` by default, zkit-offload's stores where its
config asks for NVMe (the partitioner calls these methods; it probes nothing)."""
from __future__ import annotations

import torch

from zkit.core.allocator import Allocator
from zkit.core.stores import MasterStore, ParamShardStore
from zkit_offload import HostAllocator, NVMeAllocator
from zkit_offload.config import OffloadOptimizerConfig, OffloadParamConfig


class _Plain(Allocator):
    def place(self, purpose):
        return self.device


def test_an_allocator_keeps_everything_in_its_buffers_by_default():
    for alloc in (_Plain(torch.device("cpu")), HostAllocator(torch.device("cpu"))):
        assert alloc.master_store([4, 4]) is None
        assert alloc.param_shard_store(torch.float32) is None
        assert alloc.optimizer_stepper() is None


def test_the_nvme_allocator_answers_with_its_stores(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "p").mkdir()
    alloc = NVMeAllocator(torch.device("cpu"),
                          optimizer=OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path / "o")),
                          param=OffloadParamConfig(device="nvme", nvme_path=str(tmp_path / "p")))
    try:
        assert isinstance(alloc.master_store([4, 4]), MasterStore)
        assert isinstance(alloc.param_shard_store(torch.float32), ParamShardStore)
        assert alloc.optimizer_stepper() == alloc.step_optimizer
    finally:
        alloc.close()


def test_nvme_for_parameters_only_keeps_the_master_in_memory(tmp_path):
    alloc = NVMeAllocator(torch.device("cpu"), param=OffloadParamConfig(device="nvme", nvme_path=str(tmp_path)))
    try:
        assert alloc.master_store([4]) is None
        assert isinstance(alloc.param_shard_store(torch.bfloat16), ParamShardStore)
    finally:
        alloc.close()
