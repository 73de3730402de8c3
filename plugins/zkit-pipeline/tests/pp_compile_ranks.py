"""Rank functions of ``test_pipeline_compile.py``: a 2-stage PipelineModule trained eagerly, after
``engine.compile()``, and given to ``initialize`` as ``torch.compile(module)`` (module level: ranks
are separate processes)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zkit
from zkit.testing import CountingBackend
from pp_engine_ranks import STAGES, config, data, untied_layers
from zkit_pipeline import PipelineModule

STAGE = 1  # a partitioner that hooks backward; stages 0-2 compile alike (tests/test_compile.py)


def train(how: str, schedule: str, checkpoint_interval: int = 0) -> dict[str, Any]:
    """``how``: ``"eager"``, ``"engine.compile"`` or ``"torch.compile(model)"``; a
    ``checkpoint_interval`` recomputes each run of that many layers in backward (zkit's checkpoint,
    traced by Dynamo inside the compiled chunk)."""
    torch._dynamo.reset()
    module = PipelineModule(untied_layers(), STAGES, F.mse_loss, partition_method="uniform", schedule=schedule,
                            virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                            activation_checkpoint_interval=checkpoint_interval)
    backend = CountingBackend("aot_eager")
    model = torch.compile(module, backend=backend) if how == "torch.compile(model)" else module
    engine, *_ = zkit.initialize(model=model, config=config(STAGE))
    if how == "engine.compile":
        engine.compile(backend=backend)
    losses = [float(engine.train_batch(iter(step[0]))) for step in data(1)]
    eval_loss = float(engine.eval_batch(iter(data(1)[0][0])))
    out = {"losses": losses, "eval_loss": eval_loss, "compiled": engine.is_compiled, "graphs": backend.graphs,
           "names": [n for n, _ in engine.module.named_parameters()],
           "params": [p.detach().clone() for p in engine.module.parameters()]}
    engine.close()
    return out


#: (how, schedule, activation checkpoint interval) compiled, each compared with the eager run of
#: its schedule and interval
COMPILED = [("engine.compile", "1f1b", 0), ("torch.compile(model)", "interleaved_1f1b", 0),
            ("engine.compile", "1f1b", 1)]


def compare() -> dict[str, Any]:
    runs = {}
    for how, schedule, interval in COMPILED:
        runs[("eager", schedule, interval)] = train("eager", schedule, interval)
        runs[(how, schedule, interval)] = train(how, schedule, interval)
    return {"rank": dist.get_rank(), "runs": runs}
