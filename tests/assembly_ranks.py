"""Rank functions of the assembly test: a communicator registered by a third party, chosen by the
stack, carries every collective (module level so spawned ranks can import them)."""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit
from zkit.torch_distributed.communicator import TorchCommunicator
from zkit.core.records import CommunicatorRecord

#: every communicator the plugin's factory made since the last phase, with the group asked for
MADE: list["CountingCommunicator"] = []


class CountingCommunicator(TorchCommunicator):
    """torch's collectives, counted per call kind by the inherited stats (the plugin's own class)."""

    def __init__(self, group: Any = None, config: Any = None) -> None:
        super().__init__(group, config)
        self.asked_group = group
        #: broadcasts issued through this object, whatever its stats were reset to since
        self.broadcasts = 0
        MADE.append(self)

    def broadcast(self, tensor, src, async_op=False):
        self.broadcasts += 1
        return super().broadcast(tensor, src, async_op)


class CountingPlugin:
    @zkit.hookimpl
    def zkit_register_communicators(self):
        yield CommunicatorRecord(name="counting", factory=CountingCommunicator, description="counts calls")


PLUGIN = CountingPlugin()
STACK = zkit.Stack(communicator="counting", plugins=(PLUGIN,))


def _calls(groups: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Calls per kind of the counting communicators made since the last phase, by group name
    (``"world"`` for the default group); then forget them."""
    out: dict[str, dict[str, int]] = {}
    for comm in MADE:
        name = "world" if comm.asked_group is None else next(
            (n for n, g in groups.items() if g is comm.asked_group), "other")
        for kind, v in comm.stats().items():
            out.setdefault(name, {})[kind] = out.get(name, {}).get(kind, 0) + v["calls"]
    MADE.clear()
    return out


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}, **extra}


def _step(engine: Any, x: torch.Tensor) -> None:
    engine.backward(engine(x).square().mean())
    engine.step()


def zero_and_init() -> dict[str, Any]:
    """zero.Init's broadcasts, then ZeRO-3's gathers and reductions."""
    torch.manual_seed(dist.get_rank())
    with zkit.zero.Init(config=_config(3), stack=STACK):
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    out = {"init": _calls({})}
    engine, *_ = zkit.initialize(model=model, config=_config(3), stack=STACK)
    _step(engine, torch.randn(2, 8))
    out["engine"] = _calls({})
    engine.close()
    return out


def setup_broadcast() -> dict[str, Any]:
    """initialize's broadcast of rank 0's weights (ranks seeded differently) goes through the
    chosen communicator and is left out of the step statistics."""
    torch.manual_seed(dist.get_rank())
    engine, *_ = zkit.initialize(model=nn.Linear(8, 8), config=_config(1), stack=STACK)
    weights = [torch.zeros_like(engine.module.weight) for _ in range(2)]
    dist.all_gather(weights, engine.module.weight.detach())
    out = {"broadcasts": sum(c.broadcasts for c in MADE), "stats": engine.comm_stats(),
           "same": bool(torch.equal(weights[0], weights[1]))}
    MADE.clear()
    engine.close()
    return out


def activations() -> dict[str, Any]:
    """partition_activations over a torch process group given to configure(engine, group=...)."""
    engine, *_ = zkit.initialize(model=nn.Linear(8, 8), config=_config(1), stack=STACK)
    MADE.clear()
    group = dist.new_group([0, 1])
    zkit.activations.recompute.configure(engine, group=group, partition_activations=True)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True) * 2  # not a leaf: a saved input that is split
    zkit.activations.recompute.checkpoint(layer, x).sum().backward()
    zkit.activations.recompute.reset()
    out = _calls({"activations": group})
    engine.close()
    return out


def pipeline() -> dict[str, Any]:
    """A 2-stage pipeline with a weight tied across the stages and clipping: point-to-point
    transfers, the tied gradients' sum, the grid norm and the loss broadcast."""
    from zkit_pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    layers = [TiedLayerSpec("w", nn.Linear, 8, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 8),
              TiedLayerSpec("w", nn.Linear, 8, 8)]
    module = PipelineModule(layers, 2, F.mse_loss, partition_method="uniform")
    cfg = _config(1, gradient_accumulation_steps=2, gradient_clipping=1e-3)
    engine, *_ = zkit.initialize(model=module, config=cfg, stack=STACK)
    batch = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(2)]
    engine.train_batch(iter(batch))
    tied = next(iter(module._tied_comms.values())).group
    out = _calls({"tied": tied, **module.grid_groups})
    engine.close()
    return out


def tensor_parallel() -> dict[str, Any]:
    """Layers split over the tensor axis, built before the engine, talk through its communicator."""
    from zkit_pipeline.tensor_parallel import ColumnParallelLinear, TensorParallelModule

    torch.manual_seed(0)
    module = TensorParallelModule(lambda comm: ColumnParallelLinear(8, 8, comm, gather_output=True), tensor=2)
    engine, *_ = zkit.initialize(model=module, config=_config(1), stack=STACK)
    for comm in MADE:  # kept (the engine bound the layers to them): count the forward only
        comm.reset_stats()
    engine(torch.randn(2, 8)).sum()
    return _calls(dict(module.grid_groups))


def everywhere() -> dict[str, Any]:
    return {"zero": zero_and_init(), "setup": setup_broadcast(), "activations": activations(), "pipeline": pipeline(),
            "tensor": tensor_parallel()}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through tests/test_assembly.py")
