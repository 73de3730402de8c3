"""torch.compile over zkit's activation checkpointing: regions that need no bookkeeping compile
into the surrounding graph (as torch's own checkpoint does); those that need it (profile, host
copies, the tensor-parallel RNG replay) run eagerly at a graph break, with the eager run's numbers
and a warning naming why (``zkit.activations.tracing``)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import zkit
import zkit.activations.recompute as ckpt
from zkit.activations.replayed_rng import trackers
from zkit.models.gpt import GPT, GPTConfig
from zkit.testing import CountingBackend, run_ranks

D = 16
STEPS = 3


@pytest.fixture(autouse=True)
def _fresh():
    # a tracker another test seeded would make every region replay it, eagerly
    seeded = [(tracker, dict(tracker.states)) for tracker in trackers()]
    for tracker, _ in seeded:
        tracker.states.clear()
    ckpt.reset()
    torch._dynamo.reset()
    yield
    ckpt.reset()
    torch._dynamo.reset()
    for tracker in trackers():  # also one a test made and seeded: later tests would replay it
        tracker.states.clear()
    for tracker, states in seeded:
        tracker.states.update(states)


class Block(nn.Module):
    def __init__(self, tensor_parallel_dropout: bool = False) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Dropout(0.2)
        self.tensor_parallel_dropout = tensor_parallel_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        if self.tensor_parallel_dropout:  # a split activation: dropout from the tensor-parallel stream
            from zkit_pipeline.tensor_parallel.rng_tracker import get_rng_tracker

            with get_rng_tracker().fork():
                h = self.drop(h)
        return x + self.drop(self.down(h))


class Net(nn.Module):
    """Four blocks, each checkpointed by ``checkpoint(block, x)``."""

    def __init__(self, checkpoint, tensor_parallel_dropout: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList(Block(tensor_parallel_dropout) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.checkpoint(block, x)
        return x.square().mean()


def _torch_checkpoint(block, x):
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


def _train(model: nn.Module, compiled: bool, input_grad: bool = False):
    """Losses and gradients of ``STEPS`` steps, and the backend that counted the graphs."""
    backend = CountingBackend()
    run = torch.compile(model, backend=backend) if compiled else model
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1), requires_grad=input_grad)
    torch.manual_seed(5)
    losses, grads = [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss = run(x)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads, backend


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _assert_same(a, b) -> None:
    (losses_a, grads_a, _), (losses_b, grads_b, _) = a, b
    assert losses_a == losses_b
    assert all(torch.equal(x, y) for step_a, step_b in zip(grads_a, grads_b) for x, y in zip(step_a, step_b))


def test_checkpointed_blocks_compile_into_one_graph_as_with_torch_s_checkpoint():
    """zkit's checkpoint counted its calls in a closure, which Dynamo cannot trace inside torch's
    checkpoint operator: a graph break at every block, each block run eagerly."""
    torch._dynamo.utils.counters.clear()
    *_, reference = _train(Net(_torch_checkpoint), compiled=True)
    assert (reference.graphs, _graph_breaks()) == (1, 0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _train(Net(ckpt.checkpoint), compiled=True)
    assert (compiled[2].graphs, _graph_breaks()) == (1, 0)
    _assert_same(compiled, _train(Net(ckpt.checkpoint), compiled=False))


def test_reentrant_checkpoint_under_compile_equals_eager():
    def reentrant(block, x):
        return ckpt.checkpoint(block, x, use_reentrant=True)

    # the reentrant checkpoint differentiates only through inputs that require gradients
    compiled = _train(Net(reentrant), compiled=True, input_grad=True)
    _assert_same(compiled, _train(Net(reentrant), compiled=False, input_grad=True))


@pytest.mark.parametrize("options, reason", [
    ({"profile": True}, "activation_checkpointing.profile"),
    ({"synchronize": True}, "activation_checkpointing.synchronize_checkpoint_boundary"),
    ({"checkpoint_in_cpu": True}, "activation_checkpointing.cpu_checkpointing"),
    ({"checkpoint_in_cpu": True, "contiguous_checkpointing": True}, "activation_checkpointing.cpu_checkpointing"),
    ({"tensor_parallel_dropout": True}, "the replay of a seeded RNG tracker (tensor-parallel dropout)"),
])
def test_regions_needing_bookkeeping_run_eagerly_under_compile_with_eager_numbers(options, reason, caplog):
    options = dict(options)
    tensor_parallel = options.pop("tensor_parallel_dropout", False)
    if tensor_parallel:
        model_parallel_seed = pytest.importorskip("zkit_pipeline.tensor_parallel.rng_tracker").model_parallel_seed

    def runs(compiled: bool):
        ckpt.reset()
        ckpt.configure(None, **options)
        if tensor_parallel:
            model_parallel_seed(7, tensor_rank=0)
        out = _train(Net(ckpt.checkpoint, tensor_parallel), compiled)
        return out, ckpt.profile_report()

    with caplog.at_level(logging.WARNING, logger="zkit.activations.recompute"):
        (eager, eager_profile), (compiled, compiled_profile) = runs(False), runs(True)
    _assert_same(compiled, eager)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert warnings == [
        f"torch.compile: checkpointed regions run eagerly, each at a graph break, because of {reason}; "
        "without these the regions compile into the surrounding graph"
    ]
    counts = {name: (r["calls"], r["recomputes"]) for name, r in compiled_profile.items()}
    assert counts == {name: (r["calls"], r["recomputes"]) for name, r in eager_profile.items()}
    if "profile" in options:
        assert counts == {"Block": (4 * STEPS, 4 * STEPS)}


def test_profile_under_compile_does_not_recompile_at_every_step():
    """Traced, the profile's counters became guards of the compiled frame: a recompile per step
    until Dynamo's recompile limit, after which the forward ran uncompiled."""
    ckpt.configure(None, profile=True)
    model = Net(ckpt.checkpoint)
    run = torch.compile(model, backend=CountingBackend())
    x = torch.randn(2, 8, D)
    compiled_frames = []
    for _ in range(4):
        run(x).backward()
        compiled_frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert compiled_frames[0] == compiled_frames[-1], f"frames compiled after each step: {compiled_frames}"
    assert ckpt.profile_report()["Block"]["calls"] == 16


def _engine_run(stage: int, checkpointed: bool, compiled: bool) -> tuple[list[float], list[torch.Tensor], tuple]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, dropout=0.2))
    if checkpointed:
        ckpt.apply(model, "every")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {"number_checkpoints": 3},
    }
    engine, *_ = zkit.initialize(model=model, config=config)
    backend = CountingBackend()
    if compiled:
        engine.compile(backend=backend)
    ids = torch.randint(0, 64, (STEPS, 2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    losses = []
    for step in range(STEPS):
        loss = engine(ids[step], ids[step])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return losses, params, (backend.graphs, _graph_breaks())


@pytest.mark.parametrize("stage", [2])  # its gradient hooks fire from the compiled backward
def test_engine_compile_with_checkpointed_blocks_trains_as_eager_in_as_many_graphs_and_breaks(stage):
    eager_losses, eager_params, _ = _engine_run(stage, checkpointed=True, compiled=False)
    losses, params, graphs = _engine_run(stage, checkpointed=True, compiled=True)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    *_, unchecked_graphs = _engine_run(stage, checkpointed=False, compiled=True)
    assert graphs == unchecked_graphs  # (graphs, graph breaks): checkpointing adds none
    assert graphs[0] >= 1


def partition_under_compile_rank() -> tuple[bool, int]:
    """One step of a GPT whose blocks store a half of each input per rank, compiled and eager."""
    from zkit.torch_distributed.communicator import TorchCommunicator
    from zkit.zero.device_allocator import DeviceAllocator
    from test_checkpointing import CFG, _fake_engine, _grads, checked_step

    alloc = DeviceAllocator(torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(CFG)  # same weights and inputs on both ranks: a tensor-parallel group's replicas
    ckpt.configure(_fake_engine(alloc, partition_activations=True), group=TorchCommunicator())
    ckpt.apply(model, "every")
    reference = _grads(model)
    model.compile(backend=CountingBackend())
    return checked_step(model, reference, alloc)


def test_partitioned_inputs_under_compile_are_split_with_eager_gradients():
    from test_checkpointing import CFG

    for same, stored in run_ranks(partition_under_compile_rank, 2, timeout=300):
        assert same
        assert stored == CFG.n_layer * CFG.seq_len * CFG.d_model * 4  # half of two sequences' fp32 inputs


class SharedDropoutNet(nn.Module):
    """One block checkpointed at two call sites; its forward reads its dropout probability
    ``self.p``, which a schedule changes every step."""

    def __init__(self, checkpoint) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpoint = checkpoint
        self.inp, self.lin = nn.Linear(D, D), nn.Linear(D, D)
        self.p = 0.1

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.dropout(torch.tanh(self.lin(x)), self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(2):
            x = self.checkpoint(self.block, x)
        return x.square().mean()


def _scheduled_dropout_run(stage: int, checkpoint, compiled: bool) -> tuple[list[float], list[torch.Tensor], int]:
    torch._dynamo.reset()
    model = SharedDropoutNet(checkpoint)
    backend = CountingBackend()

    def schedule(step: int) -> None:
        model.p = 0.1 + 0.05 * step

    losses, params = _engine_steps(model, stage, backend if compiled else None, (2, D), schedule)
    return losses, params, backend.graphs


def _engine_steps(model: nn.Module, stage: int, backend, shape: tuple, before_step=None):
    """Losses and final parameters of ``STEPS`` engine steps at ZeRO ``stage``, compiled with
    ``backend`` unless it is ``None``; ``before_step(step)`` runs before each."""
    engine, *_ = zkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage}})
    if backend is not None:
        engine.compile(backend=backend)
    x = torch.randn(STEPS, *shape, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    losses = []
    for step in range(STEPS):
        if before_step is not None:
            before_step(step)
        loss = engine(x[step])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return losses, params


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("checkpoint", [_torch_checkpoint, ckpt.checkpoint], ids=["torch", "zkit"])
def test_engine_compile_traces_a_checkpointed_block_reading_a_scheduled_float_as_eager(stage, checkpoint):
    """The float became a graph input once it changed, and Dynamo crashed ("lift_tracked_freevar_to_input
    should not be called on root SubgraphTracer") at the block's second checkpointed call site."""
    eager_losses, eager_params, _ = _scheduled_dropout_run(stage, checkpoint, compiled=False)
    losses, params, graphs = _scheduled_dropout_run(stage, checkpoint, compiled=True)
    # the same dropout masks; the compiled graph rounds the float constant's scaling once differently
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(params, eager_params, rtol=1e-5, atol=1e-6)
    assert graphs >= 1


def _stage3_run(compiled: bool):
    """Losses and parameters of ``STEPS`` steps at stage 3 of ``Net``, whose blocks the model
    checkpoints with torch's checkpoint, and the backend (engine.compile compiles block by block)."""
    from composition_evidence import RegionCountingBackend

    torch._dynamo.reset()
    backend = RegionCountingBackend()
    losses, params = _engine_steps(Net(_torch_checkpoint), 3, backend if compiled else None, (2, 8, D))
    return losses, params, backend


def test_stage3_recomputes_a_checkpointed_block_with_its_compiled_forward_as_eager():
    """Stage 3 compiles each block's forward, which the model's checkpoint calls again in backward.
    The FLOP probe's first backward ran that recomputation under its dispatch mode, where Dynamo
    refused the block's forward for good: every later forward and recomputation ran uncompiled."""
    eager_losses, eager_params, _ = _stage3_run(compiled=False)
    losses, params, backend = _stage3_run(compiled=True)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(params, eager_params, rtol=1e-5, atol=1e-6)
    assert backend.regions == 0  # the checkpoints are the model's, eager around the compiled blocks
    assert backend.recomputed > 0, "no recomputation ran a compiled block forward"
