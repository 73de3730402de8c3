"""PipelineModule: a model written as a flat list of layers, cut into pipeline stages.

Each rank builds only the layers of its own stage: a :class:`LayerSpec` records a layer's class and
arguments and is built where it is needed (so a model too large for one rank can be described),
and its parameter count for balancing is taken from a build on the ``meta`` device, which allocates
nothing. A :class:`TiedLayerSpec` shares one module (an embedding used again as the LM head) among
all the stages that use its key; their gradients are summed over those stages after backward.

When torch.distributed is initialised, construction is collective: the module lays the world out
as a :class:`~zkit_pipeline.topology.ProcessGrid` (``topology``, default ``pipe = num_stages``
and the rest data parallel), creates the grid's groups, and exposes its data-parallel group as
``data_parallel_group``: the engine builds its partitioner's communicator on that group, so ZeRO
reduces gradients only among replicas of the same stage.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zkit.activations import checkpoint
from zkit.torch_distributed import DeferredCommunicator
from zkit.core.model_parts import pipeline_under_init_refusal
from zkit.zero import building_under_init
from zkit_pipeline.partition_layers import balanced_bounds, layer_weights
from zkit_pipeline.topology import ProcessGrid


class LayerSpec:
    """``LayerSpec(nn.Linear, 16, 16)`` builds ``nn.Linear(16, 16)`` on its owning stage only."""

    def __init__(self, typename: type[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every spec with the same ``key``. ``forward_fn(module,
    x)``, when given, is used instead of ``module(x)`` (an LM head reusing an embedding's weight)."""

    def __init__(self, key: str, typename: type[nn.Module], *args: Any,
                 forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn


class _Tied(nn.Module):
    """One use of a tied module, with its own forward."""

    def __init__(self, module: nn.Module, forward_fn) -> None:
        super().__init__()
        self.tied = module
        self.forward_fn = forward_fn

    def forward(self, x):
        return self.forward_fn(self.tied, x) if self.forward_fn else self.tied(x)


def _describe(layer: Any) -> tuple[int, str]:
    """(trainable parameter count, class name) of a layer without allocating it."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            module = layer.build()
        name = layer.typename.__name__
    elif isinstance(layer, nn.Module):
        module, name = layer, type(layer).__name__
    else:  # a plain function
        return 0, getattr(layer, "__name__", type(layer).__name__)
    return sum(p.numel() for p in module.parameters() if p.requires_grad), name


class PipelineModule(nn.Module):
    """The layers of one pipeline stage (all its chunks) of a model given as a layer list.

    ``layers`` holds modules, :class:`LayerSpec` s, :class:`TiedLayerSpec` s or plain functions
    (``lambda x: x.flatten(1)``). ``loss_fn(output, labels)`` runs on the last stage. With
    ``virtual_stages = v`` the layers are cut into ``num_stages * v`` parts and this stage holds
    parts ``stage_id, stage_id + p, ...`` (for interleaved schedules).
    ``activation_checkpoint_interval = k > 0`` recomputes each run of ``k`` layers in backward
    instead of keeping its activations, through :func:`zkit.activations.recompute.checkpoint`: the
    engine's ``activation_checkpointing`` section applies (``cpu_checkpointing``, ``profile``, and
    ``partition_activations`` over the stage's tensor-parallel ranks).

    ``stage_id`` defaults to this rank's pipe coordinate in ``topology`` (needs torch.distributed);
    ``topology`` defaults to ``ProcessGrid(pipe=num_stages, data=world // num_stages)``.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        stage_id: int | None = None,
        topology: ProcessGrid | None = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        virtual_stages: int = 1,
        schedule: str = "1f1b",
    ) -> None:
        super().__init__()
        layers = list(layers)
        #: name of the step-scheduler record ``engine.train_batch`` runs this module with
        self.schedule = schedule
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineModule: num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be an int >= 1, got {virtual_stages!r}")
        distributed = dist.is_available() and dist.is_initialized()
        #: the process grid and this rank's groups of it (``None`` / empty without torch.distributed)
        self.grid: ProcessGrid | None = None
        self.grid_groups: dict[str, Any] = {}
        #: the group of this stage's data-parallel replicas (read by the engine), or None
        self.data_parallel_group: Any = None
        if distributed:
            self.grid = topology if topology is not None else _default_grid(num_stages)
            if self.grid.degree("pipe") != num_stages:
                raise ValueError(
                    f"PipelineModule: the topology has {self.grid.degree('pipe')} pipeline stages but "
                    f"num_stages is {num_stages}"
                )
            own = self.grid.coord(dist.get_rank()).pipe
            if stage_id is None:
                stage_id = own
            elif stage_id != own:
                raise ValueError(
                    f"PipelineModule: stage_id {stage_id} disagrees with the topology, which makes rank "
                    f"{dist.get_rank()} pipeline stage {own}"
                )
        elif topology is not None:
            raise ValueError("PipelineModule: topology= needs torch.distributed to be initialised")
        if stage_id is None:
            raise ValueError(
                "PipelineModule: stage_id is required when torch.distributed is not initialised"
            )
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"PipelineModule: stage_id must be in [0, {num_stages}), got {stage_id}")
        parts = num_stages * virtual_stages
        if len(layers) < parts:
            raise ValueError(
                f"PipelineModule: {len(layers)} layers cannot be split over {num_stages} stages x "
                f"{virtual_stages} virtual stages; every stage needs at least one layer"
            )
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"PipelineModule: activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        if num_stages > 1 and building_under_init():
            # Init partitions each module over every rank as it is built, and each stage builds
            # only its own layers: the collectives would not match (nor hold a tied module's copies)
            raise ValueError(f"PipelineModule: {pipeline_under_init_refusal(num_stages)}")
        self.num_stages, self.stage_id, self.virtual_stages = num_stages, stage_id, virtual_stages
        self.loss_fn = loss_fn
        self.checkpoint_interval = activation_checkpoint_interval
        counts, names = zip(*(_describe(layer) for layer in layers))
        self.bounds = balanced_bounds(layer_weights(partition_method, counts, names), parts)
        self.tied_modules = nn.ModuleDict()
        #: key -> communicator over the stages sharing it (set up by :meth:`setup_tied`)
        self._tied_comms: dict[str, Any] = {}
        #: key -> stages using it (for the gradient all-reduce)
        self.tied_stages: dict[str, list[int]] = {}
        for k, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                stage = self._owner(k)
                self.tied_stages.setdefault(layer.key, [])
                if stage not in self.tied_stages[layer.key]:
                    self.tied_stages[layer.key].append(stage)
        self.chunks = nn.ModuleList()
        self._funcs: list[list[Any]] = []
        for c in range(virtual_stages):
            v = c * num_stages + stage_id
            built = [self._build(layers[i]) for i in range(self.bounds[v], self.bounds[v + 1])]
            self.chunks.append(nn.ModuleList(m for m in built if isinstance(m, nn.Module)))
            self._funcs.append(built)
        if self.grid is not None:
            # collective, in the same order on every rank: the axis groups, then the tied groups
            self.grid_groups = self.grid.build_groups(dist.get_rank())
            self.data_parallel_group = self.grid_groups["data"]
            self.setup_tied(self.grid, dist.get_rank())

    def _owner(self, index: int) -> int:
        for v in range(len(self.bounds) - 1):
            if self.bounds[v] <= index < self.bounds[v + 1]:
                return v % self.num_stages
        raise AssertionError("unreachable")  # pragma: no cover

    def _build(self, layer: Any) -> Any:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
            return _Tied(self.tied_modules[layer.key], layer.forward_fn)
        if isinstance(layer, LayerSpec):
            return layer.build()
        if isinstance(layer, nn.Module) or callable(layer):
            return layer
        raise TypeError(f"PipelineModule: a layer must be an nn.Module, LayerSpec or callable, got {layer!r}")

    def layer_range(self, chunk: int = 0) -> tuple[int, int]:
        """Indices ``[start, end)`` of the layer list that ``chunk`` of this stage runs."""
        v = chunk * self.num_stages + self.stage_id
        return self.bounds[v], self.bounds[v + 1]

    def forward_chunk(self, chunk: int, x: Any) -> Any:
        funcs = self._funcs[chunk]
        k = self.checkpoint_interval
        if k <= 0 or not torch.is_grad_enabled():
            for f in funcs:
                x = f(x)
            return x
        for i in range(0, len(funcs), k):
            # zkit's checkpoint: the engine's activation_checkpointing section applies (CPU copies,
            # partitioned inputs over the tensor-parallel group, the profile)
            x = checkpoint(_run_all, funcs[i : i + k], x, use_reentrant=False, name=f"pipeline layers {i}-{i + k - 1}")
        return x

    def forward(self, x: Any, chunk: int | None = None) -> Any:
        """Run the layers of this stage's ``chunk``. The pipeline runner calls the module this way, so
        that ``torch.compile`` of the module (``engine.compile()``) compiles the chunks, as DeepSpeed's
        pipeline engine compiles its stage module. Without ``chunk``: all the layers of a single-stage
        model."""
        if chunk is None:
            if self.num_stages * self.virtual_stages != 1:
                raise RuntimeError("PipelineModule with several stages runs through a pipeline schedule, not forward()")
            chunk = 0
        return self.forward_chunk(chunk, x)

    # -- tied weights ---------------------------------------------------------------------------
    def tied_groups(self, grid: Any) -> dict[str, list[list[int]]]:
        """For each tied key used on two or more stages: the rank groups (one per data x tensor
        coordinate) whose gradients are summed."""
        out: dict[str, list[list[int]]] = {}
        for key, stages in sorted(self.tied_stages.items()):
            if len(stages) < 2:
                continue
            out[key] = [
                sorted(grid.rank(pipe=s, data=d, tensor=t) for s in stages)
                for d in range(grid.degree("data"))
                for t in range(grid.degree("tensor"))
            ]
        return out

    def setup_tied(self, grid: Any, rank: int, communicator: Callable[[Any, Any], Any] | None = None) -> None:
        """Create the tied groups (collective over all ranks) and make every tied module start
        equal to the first stage's copy. ``communicator(group, config)`` is a communicator
        record's factory; by default each group's communicator is deferred to the engine's
        assembly (:meth:`bind_communicators`)."""
        self._tied_comms: dict[str, Any] = {}
        for key, groups in self.tied_groups(grid).items():
            for ranks in groups:
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    self._tied_comms[key] = (DeferredCommunicator(group) if communicator is None
                                             else communicator(group, None))
                    for p in self.tied_modules[key].parameters():
                        self._tied_comms[key].broadcast(p.data, src=ranks[0])

    def bind_communicators(self, assembly: Any) -> None:
        """Send the tied gradients through the communicators ``assembly`` (the engine's) gives."""
        for comm in self._tied_comms.values():
            if isinstance(comm, DeferredCommunicator):
                comm.bind(assembly)

    @property
    def model_parallel_part(self) -> tuple[str, dict[str, Any]] | None:
        """The part of the model this rank holds, for checkpoints: (name, layout of all parts);
        None without torch.distributed. Each stage's data-parallel replicas write one part."""
        if self.grid is None:
            return None
        tensor = self.grid.degree("tensor")
        name = f"pipe{self.stage_id:02d}"
        if tensor > 1:
            name += f"-tensor{self.grid.coord(dist.get_rank()).tensor:02d}"
        layout = {"pipe": self.num_stages, "tensor": tensor, "virtual_stages": self.virtual_stages,
                  "layer_bounds": list(self.bounds)}
        return name, layout

    def layer_names(self) -> dict[str, str]:
        """``{name here: name in the whole layer list}`` for every parameter and buffer this stage
        holds: ``<layer index>.<name in the layer>``, or ``tied_modules.<key>.<name>``. These are
        the names DeepSpeed's ``PipelineModule`` gives, and they do not depend on the stage count,
        so a checkpoint saved by another split maps onto this one by name."""
        out: dict[str, str] = {}
        for key, module in self.tied_modules.items():
            for n, _ in [*module.named_parameters(), *module.named_buffers()]:
                out[f"tied_modules.{key}.{n}"] = f"tied_modules.{key}.{n}"
        for c, funcs in enumerate(self._funcs):
            start, _ = self.layer_range(c)
            modules = [(i, f) for i, f in enumerate(funcs) if isinstance(f, nn.Module)]
            for j, (i, layer) in enumerate(modules):
                if isinstance(layer, _Tied):
                    continue  # its parameters are the tied module's, named above
                for n, _ in [*layer.named_parameters(), *layer.named_buffers()]:
                    out[f"chunks.{c}.{j}.{n}"] = f"{start + i}.{n}"
        return out

    def tied_copies(self) -> dict[int, int]:
        """``{id(param): stages}`` for the parameters of tied modules shared with other stages."""
        return {
            id(p): len(self.tied_stages[key])
            for key in self._tied_comms
            for p in self.tied_modules[key].parameters()
        }

    @property
    def ties_stages(self) -> bool:
        """Whether this rank holds a tied module shared with another pipeline stage."""
        return bool(self._tied_comms)

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of every tied module over the stages that share it."""
        for key, comm in self._tied_comms.items():
            for p in self.tied_modules[key].parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, op="sum")


def _default_grid(num_stages: int) -> ProcessGrid:
    world = dist.get_world_size()
    if world % num_stages:
        raise ValueError(
            f"PipelineModule: {num_stages} pipeline stages do not divide the world of {world} ranks; "
            f"choose num_stages dividing {world} or pass topology="
        )
    return ProcessGrid(pipe=num_stages, data=world // num_stages)


def _run_all(funcs, x):
    for f in funcs:
        x = f(x)
    return x
