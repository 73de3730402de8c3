"""The ZeRO partitioner's default master store: the fp32 master in memory behind the same
interface as a plugin's store (``zkit/zero/memory_store.py``), so the partitioner has one code path."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import zkit
from zkit.core.stores import MasterStore
from zkit.zero.full_state import get_full_fp32_param, set_full_fp32_param
from zkit.zero.memory_store import InMemoryMasterStore, MasterOwner
from zkit.zero.stage0 import Stage0
from zkit.zero.stage1 import Stage1
from zkit.zero.stage2 import Stage2
from zkit.zero.stage3 import Stage3

import engine_ranks as er

ZERO = pathlib.Path(zkit.__file__).parent / "zero"


def _engine(stage: int, dtype: str):
    return zkit.initialize(model=er.make_model(), config=er.config(stage, dtype, 1, 1))[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_a_plugin_store_the_master_is_in_memory_and_stepped_in_place(stage, dtype):
    engine = _engine(stage, dtype)
    try:
        part = engine.partitioner
        store = part.master_store
        assert isinstance(store, InMemoryMasterStore) and isinstance(store, MasterStore)
        assert not store.takes_grads
        # fp32 on the training device: the parameters are the master
        assert part.master_is_param == (dtype == "fp32")
        # read_master gives the shard the optimizer steps (no copy), and so do the pieces
        for (opt_param, unit, a, b, _), piece in zip(part.owned, part.pieces()):
            shard = store.read_master(unit)
            assert shard[a:b].data_ptr() == opt_param.data_ptr() == piece.master.data_ptr()
        er.train_engine(engine, 2, 1, 1)
        for opt_param, unit, a, b, _ in part.owned:
            assert torch.equal(store.read_master(unit)[a:b], opt_param.detach())
        # writing a master through the store is what the next publish copies into the parameters
        store.write_master(0, torch.full_like(store.read_master(0), 0.25))
        part.publish_params()
        with zkit.zero.GatheredParameters(part.unit_params[0]):
            assert all(torch.all(p.detach().float() == 0.25) for p in part.unit_params[0])
    finally:
        engine.close()


def test_the_in_memory_store_takes_no_gradients():
    engine = _engine(2, "bf16")
    try:
        with pytest.raises(RuntimeError, match="the in-memory master store takes no gradients"):
            engine.partitioner.master_store.add_grad(0, torch.zeros(1))
    finally:
        engine.close()


def test_the_in_memory_store_uses_only_public_members_of_its_partitioner():
    text = (ZERO / "memory_store.py").read_text()
    assert re.findall(r"owner\._\w+", text) == []
    # what it uses is the MasterOwner protocol, and the partitioners have every member of it
    used = set(re.findall(r"owner\.(\w+)", text))
    members = {n for n in vars(MasterOwner) if not n.startswith("_")} | set(MasterOwner.__annotations__)
    assert used <= members, used - members
    for cls in (Stage0, Stage1, Stage2, Stage3):
        assert all(hasattr(cls, name) for name in members - {"ctx", "allocator"}), cls
        assert not any(hasattr(cls, "_" + name) for name in members), cls


def test_the_partitioner_never_asks_whether_there_is_a_master_store():
    for path in ZERO.glob("*.py"):
        text = path.read_text()
        assert "master_store is None" not in text and "master_store is not None" not in text, path.name


@pytest.mark.parametrize("device", ["none", "nvme"])
def test_setting_one_parameters_master_writes_it_back_to_whichever_store(device, tmp_path):
    # set_full_fp32_param hands after_load the pieces of one parameter only
    pytest.importorskip("zkit_offload")
    cfg = er.config(2, "bf16", 1, 1)
    if device == "nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = zkit.initialize(model=er.make_model(), config=cfg)[0]
    try:
        weight = engine.module.mix.weight
        value = torch.arange(weight.numel(), dtype=torch.float32).reshape(weight.shape) / 64
        set_full_fp32_param(weight, value)
        assert torch.equal(get_full_fp32_param(weight), value)
        assert torch.equal(weight.detach().float(), value.bfloat16().float())
    finally:
        engine.close()
