"""TensorParallelModule: a model split over the tensor axis of a process grid and replicated over its
data axis, ready for ``zkit.initialize``::

    grid = ProcessGrid(data=2, tensor=2)
    model = TensorParallelModule(lambda tp: TensorParallelGPT(cfg, tp), grid)
    engine, *_ = zkit.initialize(model=model, config=ds_config)
    loss = model.module.loss(engine(ids), targets)

Construction is collective (it creates the grid's groups). The module exposes
``data_parallel_group``, so the engine's partitioner reduces gradients among data-parallel replicas
only, and the zkit-pipeline plugin makes the global gradient norm count a parameter replicated over
the tensor group once. Checkpoints are written per tensor rank (``model_parallel_part``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from zkit.torch_distributed import DeferredCommunicator
from zkit_pipeline.topology import ProcessGrid


class TensorParallelModule(nn.Module):
    """Builds ``build(tensor_comm)`` on this rank's tensor group and runs it as the model.

    ``topology`` defaults to ``ProcessGrid(data=world // tensor, tensor=tensor)``; its pipe degree
    must be 1 (pipeline stages are a :class:`~zkit_pipeline.PipelineModule`)."""

    def __init__(
        self,
        build: Callable[[Any], nn.Module],
        topology: ProcessGrid | None = None,
        *,
        tensor: int | None = None,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TensorParallelModule needs torch.distributed to be initialised")
        if topology is None:
            if tensor is None:
                raise ValueError("TensorParallelModule needs topology= or tensor= (the tensor-parallel degree)")
            world = dist.get_world_size()
            if not isinstance(tensor, int) or tensor < 1 or world % tensor:
                raise ValueError(
                    f"TensorParallelModule: tensor={tensor!r} must be an int >= 1 dividing the world of {world} ranks"
                )
            topology = ProcessGrid(data=world // tensor, tensor=tensor)
        elif tensor is not None and tensor != topology.degree("tensor"):
            raise ValueError(
                f"TensorParallelModule: tensor={tensor} disagrees with the topology's tensor degree "
                f"{topology.degree('tensor')}"
            )
        if topology.degree("pipe") != 1:
            raise ValueError(
                f"TensorParallelModule: the topology has {topology.degree('pipe')} pipeline stages; build "
                f"pipeline stages with PipelineModule"
            )
        self.grid = topology
        self.coord = topology.coord(dist.get_rank())
        #: this rank's torch.distributed group per axis (collective creation, same order everywhere)
        self.grid_groups = topology.build_groups(dist.get_rank())
        self.data_parallel_group = self.grid_groups["data"]
        #: the layers' collectives: the engine's communicator for this group once it is built
        #: (:meth:`bind_communicators`), until then the installed plugins' choice
        self.tensor_comm = DeferredCommunicator(self.grid_groups["tensor"])
        self.module = build(self.tensor_comm)
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"TensorParallelModule: build(tensor_comm) must return an nn.Module, got {self.module!r}")

    def bind_communicators(self, assembly: Any) -> None:
        """Send the layers' collectives through the communicator ``assembly`` (the engine's) gives."""
        self.tensor_comm.bind(assembly)

    @property
    def model_parallel_part(self) -> tuple[str, dict[str, Any]]:
        """The part of the model this rank holds, for checkpoints: (name, layout of all parts)."""
        return f"tensor{self.coord.tensor:02d}", {"pipe": 1, "tensor": self.grid.degree("tensor")}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
