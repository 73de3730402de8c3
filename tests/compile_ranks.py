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
