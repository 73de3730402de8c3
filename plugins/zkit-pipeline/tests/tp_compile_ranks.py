"""Rank functions of ``test_tensor_parallel_compile.py``: a tensor-parallel model trained through
``zkit.initialize`` eagerly and after ``engine.compile()`` (module level: ranks are separate
processes)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit
from zkit.core.communicator import Communicator
from zkit.testing import CountingBackend, counting_communicator_record
from zkit_pipeline import TensorParallelModule
from zkit_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

STEPS = 3


class TensorParallelMLP(nn.Module):
    """``h + row(tanh(column(h)))``; ``gathered``: the column layer gathers its output and the row
    layer scatters it again (an all-gather forward, the slice backward, and the reverse)."""

    def __init__(self, tp: Any, seed: int, gathered: bool = False) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(8, 16, tp, seed=seed, gather_output=gathered)
        self.proj = RowParallelLinear(16, 8, tp, seed=seed + 1, input_is_parallel=not gathered)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.fc(h)))


class Net(nn.Module):
    """Every tensor-parallel layer and mapping: a vocabulary-parallel embedding, two MLP blocks,
    a replicated head."""

    def __init__(self, tp: Any) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(16, 8, tp, seed=1)
        self.blocks = nn.ModuleList([TensorParallelMLP(tp, 2), TensorParallelMLP(tp, 4, gathered=True)])
        torch.manual_seed(0)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def counting_record():
    return counting_communicator_record("counting-tp")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (4, 6), generator=g), torch.randn(4, 6, 4, generator=g)


def train(compiled: bool, custom_comm: bool = False) -> dict[str, Any]:
    """``STEPS`` steps of ZeRO-2 over the model's single replica, eagerly or after ``engine.compile``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TensorParallelModule(Net, tensor=2)
    kwargs = {"stack": zkit.Stack(communicator=counting_record())} if custom_comm else {}
    engine, *_ = zkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}, **kwargs)
    backend = CountingBackend("aot_eager")
    if compiled:
        engine.compile(backend=backend)
    losses = []
    for step in range(STEPS):
        ids, y = batch(step)
        loss = F.mse_loss(engine(ids), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    target = model.tensor_comm.target
    out = {
        "graphs": backend.graphs,
        "graph_breaks": {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()},
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "tensor_stats": model.tensor_comm.stats(),
        "tensor_comm": type(target).__name__,
        "tensor_calls": dict(getattr(target, "calls", {})),
    }
    engine.close()
    return out


def collectives(comm: Communicator, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each collective the torch communicator traces: an averaging all-reduce, a max all-reduce,
    a reduce-scatter and an all-gather."""
    avg, top = x.clone(), x.clone()
    comm.all_reduce(avg, op="avg")
    comm.all_reduce(top, op="max")
    shard = torch.empty(x.numel() // comm.world_size)
    comm.reduce_scatter(shard, x.clone().view(-1), op="sum")
    whole = torch.empty(x.numel())
    comm.all_gather(whole, shard)
    return avg, top, whole


def traced_collectives() -> dict[str, Any]:
    """The collectives compiled as one graph (``fullgraph=True`` refuses any break) against eager."""
    import torch._dynamo
    from zkit.torch_distributed.communicator import TorchCommunicator

    torch._dynamo.reset()
    comm = TorchCommunicator()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    eager = collectives(comm, x)
    backend = CountingBackend("aot_eager")
    try:
        compiled = torch.compile(collectives, backend=backend, fullgraph=True)(comm, x)
    except Exception as exc:  # a graph break: report it rather than end the rank
        return {"error": str(exc).splitlines()[0]}
    return {"equal": [torch.equal(a, b) for a, b in zip(eager, compiled)], "graphs": backend.graphs}


def compare() -> dict[str, Any]:
    runs = {(compiled, custom): train(compiled, custom) for custom in (False, True) for compiled in (False, True)}
    return {"rank": dist.get_rank(), "runs": runs, "collectives": traced_collectives()}
