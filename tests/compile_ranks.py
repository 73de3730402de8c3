"""Rank functions of ``tests/test_compile.py`` (module level: ranks are separate processes)."""
from __future__ import annotations

import torch

import zkit
from zkit import telemetry
from zkit.testing import CountingBackend

import engine_ranks as er

STEPS = 3


def _config(stage: int, world: int) -> dict:
    return er.config(stage, "fp32", 1, world)


def train(stage: int, how: str, inner: str = "aot_eager") -> dict:
    """Train ``STEPS`` steps of the tied test model at ``stage``; ``how``: ``"eager"``,
    ``"engine.compile"`` or ``"torch.compile(model)"``. Returns losses, parameters, graphs compiled."""
    torch._dynamo.reset()
    world = torch.distributed.get_world_size()
    cfg = _config(stage, world)
    backend = CountingBackend(inner)
    model = er.make_model()
    if how == "torch.compile(model)":
        model = torch.compile(model, backend=backend)
    engine, *_ = zkit.initialize(model=model, config=cfg)
    if how == "engine.compile":
        engine.compile(backend=backend)
    losses = er.train_engine(engine, STEPS, 1, world)
    out = {"losses": losses, "params": er.params_of(engine), "graphs": backend.graphs,
           "compiled": engine.is_compiled, "names": [n for n, _ in engine.module.named_parameters()]}
    engine.close()
    return out


def compare(cases: list[tuple[int, str, str]]) -> dict:
    """Per ``(stage, how, backend)`` case: the eager run of that stage and the compiled one."""
    out: dict = {}
    for stage, how, inner in cases:
        runs = out.setdefault(stage, {})
        if "eager" not in runs:
            runs["eager"] = train(stage, "eager")
        runs[how] = train(stage, how, inner)
    return out


def probe_and_compile() -> dict:
    """The FLOPs the engine's probe counts for a compiled module and for the eager one; graphs compiled."""
    torch._dynamo.reset()
    out = {}
    for how in ("eager", "engine.compile"):
        backend = CountingBackend("eager")
        engine, *_ = zkit.initialize(model=er.make_model(), config=_config(0, 1))
        if how == "engine.compile":
            engine.compile(backend=backend)
        er.train_engine(engine, 2, 1, 1)
        out["flops" if how != "eager" else "eager_flops"] = telemetry.of(engine).step_probe.flops
        out["graphs"] = backend.graphs
        engine.close()
    return out


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class _Blocks(torch.nn.Module):
    """Three blocks in a ModuleList between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def stage3_regions(persistence: int, offload: bool = False) -> dict:
    """Stage 3 per block, eager and under engine.compile (aot_eager): losses, graphs compiled after
    the second step and after the last, and the graph breaks. ``offload``: parameters and
    optimizer on the host (zkit-offload's ``offload_param`` / ``offload_optimizer`` on cpu)."""
    from torch._dynamo.utils import counters

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence}}
    if offload:
        cfg["zero_optimization"].update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    data = torch.randn(5, world, 2, 4, generator=torch.Generator().manual_seed(3))
    out = {}
    for how in ("eager", "engine.compile"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        engine, *_ = zkit.initialize(model=_Blocks(), config=cfg)
        backend = CountingBackend()
        if how == "engine.compile":
            engine.compile(backend=backend)
        losses, graphs = [], []
        for step in range(len(data)):
            loss = engine(data[step, rank]).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            graphs.append(backend.graphs)
        out[how] = {"losses": losses, "graphs": graphs, "compiled": engine.is_compiled,
                    "breaks": sum(counters["graph_break"].values())}
        engine.close()
    return out
