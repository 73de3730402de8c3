"""Activation checkpointing: identical gradients with dropout, host copies, partitioned inputs,
policies, tied weights, and the ZeRO stages on 2 ranks."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

import zkit.activations.recompute as ckpt
from zkit.zero.device_allocator import DeviceAllocator
from zkit.core.config import ConfigError
from zkit.models.gpt import GPT, Block, GPTConfig
from zkit.testing import run_ranks

from shared_models import SharedNet

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, dropout=0.2)


@pytest.fixture(autouse=True)
def _fresh_settings():
    ckpt.reset()
    yield
    ckpt.reset()


def _grads(model: nn.Module, seed: int = 5) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    model(ids, ids).backward()
    return [p.grad.clone() for p in model.parameters()]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _fake_engine(alloc, **section):
    from zkit.core.config import load_config

    config = load_config({"train_batch_size": 1, "activation_checkpointing": section}, world_size=1)
    return types.SimpleNamespace(config=config, allocator=alloc)


@pytest.mark.parametrize("policy", ["every", "every_k:2", "type:Block", Block, lambda n, m: n == "blocks.3"])
def test_policies_give_identical_gradients_with_dropout(policy):
    model = _gpt()
    reference = _grads(model)
    names = ckpt.apply(model, policy)
    assert names and all(n.startswith("blocks.") for n in names)
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model)))
    keys = list(model.state_dict())
    assert ckpt.remove(model) == names
    assert type(model.blocks[0]) is Block and list(model.state_dict()) == keys


def test_every_k_selects_every_kth_block():
    assert ckpt.apply(_gpt(), "every_k:3") == ["blocks.0", "blocks.3"]


def test_checkpoint_function_kwargs_and_reentrant():
    model = _gpt()
    block = model.blocks[0]
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)

    def run(fn):
        torch.manual_seed(3)
        out = fn(x)
        (out * out).sum().backward()
        g = x.grad.clone()
        x.grad = None
        return out.detach(), g

    def scaled(t, *, scale):
        return block(t) * scale

    plain = run(lambda t: scaled(t, scale=2.0))
    for result in (
        run(lambda t: ckpt.checkpoint(scaled, t, scale=2.0)),
        run(lambda t: ckpt.checkpoint(block, t, use_reentrant=True) * 2.0),
    ):
        assert torch.equal(plain[0], result[0]) and torch.equal(plain[1], result[1])


def test_cpu_checkpointing_keeps_host_copies_counted_by_the_allocator():
    alloc = DeviceAllocator(torch.device("cpu"))
    ckpt.configure(_fake_engine(alloc, cpu_checkpointing=True))
    model = _gpt()
    reference = _grads(model)
    ckpt.apply(model, "every")
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(ids, ids)
    block_input = 2 * CFG.seq_len * CFG.d_model * 4
    assert alloc.stats()["activation"]["live"] == CFG.n_layer * block_input
    loss.backward()
    assert alloc.stats()["activation"]["live"] == 0
    assert all(torch.equal(a, p.grad) for a, p in zip(reference, model.parameters()))


def test_stored_input_is_a_host_copy_not_a_reference():
    from zkit.activations.settings import CheckpointSettings
    from zkit.activations.storage import InputStore

    store = InputStore(CheckpointSettings(cpu_checkpointing=True))
    t = torch.randn(5, 3) * 2
    stored = store.pack(t)
    assert stored.data.device.type == "cpu" and stored.data.data_ptr() != t.data_ptr()
    assert torch.equal(store.unpack(stored), t)
    leaf = nn.Parameter(torch.randn(3))
    assert store.pack(leaf) is leaf  # parameters are kept by reference


def test_contiguous_memory_uses_one_arena_from_the_second_step():
    ckpt.configure({"activation_checkpointing": {"cpu_checkpointing": True, "contiguous_memory_optimization": True}})
    model = _gpt()
    reference = _grads(model)
    ckpt.apply(model, "every")
    _grads(model)
    arena = ckpt._State.store.arena("cpu")
    first = arena.overflows
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model)))
    assert arena.overflows == first  # second step: everything fit in the arena
    assert arena.buffer.numel() >= CFG.n_layer * 2 * CFG.seq_len * CFG.d_model * 4
    assert arena.live == 0 and arena.offset == 0


def test_number_checkpoints_sizes_the_arena_up_front():
    ckpt.configure(checkpoint_in_cpu=True, contiguous_checkpointing=True, num_checkpoints=CFG.n_layer)
    model = _gpt()
    ckpt.apply(model, "every")
    _grads(model)
    assert ckpt._State.store.arena("cpu").overflows == 0


def test_tensor_parallel_rng_stream_is_replayed():
    rng = pytest.importorskip("zkit_pipeline.tensor_parallel.rng_tracker")
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def region(t):
        with rng.get_rng_tracker().fork():
            return torch.nn.functional.dropout(lin(t), 0.5)

    def run(fn):
        rng.model_parallel_seed(7, tensor_rank=1)
        out = fn(x)
        out.sum().backward()
        g = x.grad.clone()
        x.grad = None
        return g, rng.get_rng_tracker().states[rng.TENSOR_PARALLEL_RNG][0].clone()

    try:
        plain_grad, plain_state = run(region)
        ck_grad, ck_state = run(lambda t: ckpt.checkpoint(region, t))
    finally:  # a seeded tracker left behind would send every later region of this process down the eager path
        rng.get_rng_tracker().reset()
    assert torch.equal(plain_grad, ck_grad)
    assert torch.equal(plain_state, ck_state)  # the stream continues as without checkpointing


def test_profile_logs_forward_and_recompute(caplog):
    ckpt.configure(profile=True)
    model = _gpt()
    ckpt.apply(model, "every_k:2")
    with caplog.at_level(logging.INFO, logger="zkit.activations.recompute"):
        _grads(model)
    report = ckpt.profile_report()
    assert set(report) == {"blocks.0", "blocks.2"}
    assert all(r["calls"] == 1 and r["recomputes"] == 1 and r["forward_s"] > 0 for r in report.values())
    assert "checkpoint blocks.2: recompute" in caplog.text


def test_no_grad_runs_the_function_plainly():
    model = _gpt()
    ckpt.apply(model, "every")
    with torch.no_grad():
        assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, CFG.vocab_size)


@pytest.mark.parametrize(
    "policy, message",
    [
        ("every_k:0", "K in 'every_k:K' must be an integer >= 1"),
        ("sometimes", "unknown checkpoint policy 'sometimes'"),
        ("type:Nothing", "selects no module of GPT"),
        (3, "checkpoint policy must be"),
    ],
)
def test_bad_policies(policy, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ckpt.apply(_gpt(), policy)


def test_apply_errors():
    model = _gpt()
    ckpt.apply(model, "every")
    with pytest.raises(ValueError, match="'blocks.0' is already checkpointed; call zkit.activations.recompute.remove"):
        ckpt.apply(model, "every")
    with pytest.raises(ValueError, match="has no nn.ModuleList or nn.Sequential of blocks"):
        ckpt.apply(nn.Linear(2, 2), "every")
    with pytest.raises(TypeError, match="needs an nn.Module"):
        ckpt.apply("model", "every")


def test_configure_errors():
    with pytest.raises(ValueError, match="contiguous_memory_optimization arranges the copies"):
        ckpt.configure(contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="num_checkpoints must be an int >= 1"):
        ckpt.configure(num_checkpoints=0)
    with pytest.raises(ValueError, match="profile must be a bool"):
        ckpt.configure(profile="yes")
    with pytest.raises(TypeError, match="group= must be a zkit Communicator"):
        ckpt.configure(group=3)
    with pytest.raises(TypeError, match="takes an engine, a ZkitConfig"):
        ckpt.configure(42)
    with pytest.raises(ConfigError, match="cpu_checkpoint"):
        ckpt.configure({"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ValueError, match="takes positional arguments only"):
        ckpt.checkpoint(lambda t, k: t, torch.ones(1, requires_grad=True), use_reentrant=True, k=1)
    with pytest.raises(TypeError, match="checkpoint needs a callable"):
        ckpt.checkpoint(5, torch.ones(1))


def test_partition_without_group_is_a_noop(caplog):
    with caplog.at_level(logging.INFO, logger="zkit.activations.recompute"):
        s = ckpt.configure(partition_activations=True)
    assert not s.splits and not s.transforms_inputs
    assert "no tensor-parallel group" in caplog.text


# -- multi-rank ----------------------------------------------------------------------------------


def engine_stages_rank(cases):
    import zkit

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 32, (3, world * 2, 8), generator=g)
    out = {}
    for stage, cpu_checkpointing in cases:
        for checkpointed in (False, True):
            ckpt.reset()
            model = SharedNet()
            if checkpointed:
                ckpt.apply(model, "every")
            cfg = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "overlap_comm": True},
                "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
                "steps_per_print": 1000,
            }
            engine, *_ = zkit.initialize(model=model, config=cfg)
            ckpt.configure(engine)
            for step in range(2):
                torch.manual_seed(100 + step * world + rank)  # dropout differs per rank, same across runs
                batch = ids[step, rank * 2 : rank * 2 + 2]
                loss = engine(batch, batch)
                engine.backward(loss)
                engine.step()
            out[(stage, cpu_checkpointing, checkpointed)] = [p.detach().clone() for p in engine.module.parameters()]
            engine.close()
    return out


def test_engine_stages_with_tied_weights_match_unchecked():
    cases = [(0, False), (1, True), (2, False), (2, True)]
    results = run_ranks(engine_stages_rank, 2, args=(cases,), timeout=300)
    for stage, cpu in cases:
        for r in results:
            plain, checked = r[(stage, cpu, False)], r[(stage, cpu, True)]
            assert max((a - b).abs().max().item() for a, b in zip(plain, checked)) < 1e-6, (stage, cpu)
        assert all(torch.equal(a, b) for a, b in zip(results[0][(stage, cpu, True)], results[1][(stage, cpu, True)]))


def partition_rank():
    from zkit.torch_distributed.communicator import TorchCommunicator

    alloc = DeviceAllocator(torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(CFG)  # same weights and inputs on both ranks: a tensor-parallel group's replicas
    reference = _grads(model)
    ckpt.configure(_fake_engine(alloc, partition_activations=True, cpu_checkpointing=True), group=TorchCommunicator())
    ckpt.apply(model, "every")
    return checked_step(model, reference, alloc)


def checked_step(model, reference, alloc) -> tuple[bool, int]:
    """One forward and backward of the batch ``_grads`` takes: whether the gradients equal
    ``reference``, and the activation bytes stored between the two."""
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(ids, ids)
    stored = alloc.stats()["activation"]["live"]
    loss.backward()
    return all(torch.equal(a, p.grad) for a, p in zip(reference, model.parameters())), stored


def test_partition_activations_splits_saved_inputs_over_the_group():
    results = run_ranks(partition_rank, 2, timeout=120)
    full = CFG.n_layer * 2 * CFG.seq_len * CFG.d_model * 4
    for same, stored in results:
        assert same
        assert stored == full // 2
