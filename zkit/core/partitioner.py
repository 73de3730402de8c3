"""The partitioner interface: how model states (parameters, gradients, optimizer state) are held
and split across data-parallel ranks.

The engine drives a partitioner through a handful of calls, in this order, every micro-step::

    with partitioner.backward_context(boundary):   # boundary: last micro-step of the batch
        scaled_loss.backward()                     # partitioner's hooks bucket/reduce grads
    partitioner.after_backward(boundary)           # finish this micro-step's reductions

and at a gradient-accumulation boundary::

    norm = partitioner.grad_norm()                 # global L2 norm of the (scaled) gradients
    partitioner.step(grad_factor)                  # unscale/clip by grad_factor, step, refresh params
    partitioner.zero_grad()                        # (skip_step() instead when the step is skipped)

A partitioner owns the optimizer (:attr:`Partitioner.optimizer`, built from the context's optimizer
record over the *master* tensors it keeps) so that the LR schedule and user code see one torch
optimizer whatever the stage. For checkpoints, :meth:`Partitioner.pieces` lists which element ranges
of which parameters this rank owns; the checkpoint code saves and reshards from that alone.
"""
from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

import attrs
import torch

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.allocator import Allocator
    from zkit.core.communicator import Communicator
    from zkit.core.config import ZkitConfig
    from zkit.core.records import OptimizerRecord


#: the attribute a parameter built already partitioned (``zkit.zero.Init``) carries, naming its
#: unit: the engine leaves such a parameter to its partitioner (no cast, no broadcast from rank 0)
PARTITIONED_ATTR = "_zkit_unit"


def built_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` was built already partitioned (see :data:`PARTITIONED_ATTR`)."""
    return getattr(param, PARTITIONED_ATTR, None) is not None


@attrs.define(kw_only=True)
class PartitionContext:
    """Everything a partitioner factory is given."""

    module: torch.nn.Module
    #: torch-style param groups over the module's trainable parameters (user options kept).
    param_groups: list[dict[str, Any]]
    config: "ZkitConfig"
    comm: "Communicator"
    allocator: "Allocator"
    optimizer: "OptimizerRecord"
    optimizer_params: dict[str, Any]
    device: torch.device
    #: dtype of the model's parameters during forward/backward (fp16, bf16 or fp32).
    dtype: torch.dtype


@attrs.frozen
class Piece:
    """An element range ``[start, end)`` of the flattened parameter ``name`` that this rank owns
    (its fp32 master copy and optimizer state)."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    #: the fp32 master values of the range (a view this rank may write into on load).
    master: torch.Tensor
    #: the torch-optimizer "parameter" whose state holds this range's optimizer state.
    opt_param: torch.Tensor


@attrs.frozen
class GradPiece:
    """The reduced gradient of the element range ``[start, end)`` of the flattened parameter
    ``name`` that this rank owns (the same ranges as :meth:`Partitioner.pieces`)."""

    name: str
    start: int
    end: int
    #: a view of the partitioner's reduced gradient (model, communication or accumulation dtype),
    #: still multiplied by the loss scale; read it, do not keep it past the step.
    grad: torch.Tensor


@runtime_checkable
class ReducedGradients(Protocol):
    """A partitioner that shows the gradients it reduced, for code that needs more than their
    global norm (the grid-wide norm of a model split over tensor- or pipeline-parallel ranks
    weighs replicated parameters). Valid between the last backward of a batch and the step."""

    #: True when the ranks' pieces add up to the whole model (ZeRO 1-3); False when every rank
    #: holds every piece (ZeRO 0).
    shards_states: bool

    @property
    def shows_reduced_grads(self) -> bool:
        """False where the reduced gradients are kept out of memory (a master store that takes them:
        zkit-offload's NVMe), so :meth:`reduced_grads` cannot show them: known when the
        partitioner is built, so that code needing them refuses at initialize."""
        ...

    def reduced_grads(self) -> list[GradPiece]:
        """This rank's reduced gradient pieces."""
        ...


@runtime_checkable
class ReductionPolicy(Protocol):
    """An optimizer that says, step by step, whether the gradients reaching it must be reduced
    over the data-parallel ranks (1-bit Adam's compressed momentum steps and 0/1 Adam's local
    steps exchange something else, or nothing). The partitioner asks its optimizer; an optimizer
    without this property always gets reduced gradients."""

    @property
    def needs_gradient_reduction(self) -> bool: ...


class Partitioner(abc.ABC):
    """Base class of every partitioner. See the module docstring for the call order."""

    #: the ZeRO stage this partitioner implements (None for third-party schemes).
    stage: int | None = None

    def __init__(self, ctx: PartitionContext) -> None:
        self.ctx = ctx
        self.module = ctx.module
        self.comm = ctx.comm
        self.allocator = ctx.allocator
        self.optimizer: torch.optim.Optimizer  # set by subclasses

    @property
    def gradient_reduction(self) -> bool:
        """Whether gradients are reduced over the ranks for the coming step: yes, unless the
        optimizer is a :class:`ReductionPolicy` that needs none now."""
        optimizer = getattr(self, "optimizer", None)  # None while a subclass is being built
        return not isinstance(optimizer, ReductionPolicy) or optimizer.needs_gradient_reduction

    # -- forward / backward ----------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context the engine runs the module's forward in (stage 3 gathers parameters there)."""
        return contextlib.nullcontext()

    def wait_for_parameters(self) -> None:
        """Block until every parameter holds its current value (a partitioner that refreshes
        parameters in the background after the step waits for that here)."""

    def backward_context(self, boundary: bool) -> contextlib.AbstractContextManager:
        """Context the engine runs ``loss.backward()`` in; ``boundary`` says whether this is the
        last micro-step before an optimizer step (when gradients must be reduced)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def after_backward(self, boundary: bool) -> None:
        """Finish the gradient reductions of this micro-step."""

    # -- step ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients (still multiplied by the loss scale) over all ranks,
        as a 0-dim fp32 tensor; ``inf``/``nan`` when any rank has an overflow."""

    def grads_finite(self) -> torch.Tensor | None:
        """Whether this rank's gradients after reduction (those it steps) are all finite, as a 0-dim
        bool tensor, for the engine's check when nothing computes :meth:`grad_norm`. ``None`` (the
        default): this partitioner cannot tell cheaply, and the loss alone is checked."""
        return None

    @abc.abstractmethod
    def step(self, grad_factor: float | torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
        """Multiply the gradients by ``grad_factor`` (unscale and clip at once; a float, or a 0-dim
        tensor on the training device), step the optimizer on the master tensors and bring the
        model parameters up to date. ``found_inf`` (a 0-dim fp32 tensor on the training device,
        non-zero when the batch's loss or gradients were not finite): then leave parameters and
        optimizer state unchanged instead, on the device where the optimizer can (torch's fused
        kernels take it), else after reading it (:meth:`skip_step`)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""

    def skip_step(self) -> None:
        """Forget the batch without stepping (its loss or gradients were not finite). A
        partitioner that applied part of the step already raises :class:`FloatingPointError`
        saying so. Default: :meth:`zero_grad`."""
        self.zero_grad()

    def step_kernel(self) -> str:
        """What :meth:`step` runs, in words, for the step log (logged once, at the first step)."""
        return f"{type(self.optimizer).__name__}.step"

    # -- state ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def pieces(self) -> list[Piece]:
        """The parameter ranges this rank owns, for checkpoints. With replicated states (stage 0)
        every rank owns everything and only rank 0 writes (see :meth:`writes_checkpoint`)."""

    def writes_checkpoint(self) -> bool:
        """Whether this rank's pieces go to disk (False on ranks that hold a replica)."""
        return True

    def after_load(self, pieces: list[Piece]) -> None:
        """Called after a checkpoint was copied into ``pieces`` (what :meth:`pieces` returned):
        store masters kept outside the parameters, refresh the model's parameters."""

    def memory(self) -> dict[str, int]:
        """Bytes of model states this rank holds, by kind (params, grads, master, optim_state)."""
        return {p: s["live"] for p, s in self.allocator.stats().items()}

    def compile_regions(self) -> list[torch.nn.Module] | None:
        """The submodules ``engine.compile()`` compiles one by one (regional compilation), with what
        this partitioner does around them left outside the compiled code; ``None`` (the default):
        the whole module's forward is compiled, or the record's ``compile_refusal`` raised."""
        return None

    def gathered(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
        """A context in which ``params`` hold their whole values; every rank enters it (a
        partitioner that keeps parameters partitioned gathers them). Default: nothing to do."""
        return contextlib.nullcontext()

    def gathers_for_16bit_save(self) -> bool:
        """Whether ``engine.save_16bit_model`` may gather partitioned parameters whole, module by
        module, to write them (ZeRO stage 3 answers from ``stage3_gather_16bit_weights_on_model_save``;
        without it the save writes nothing and warns, as DeepSpeed's). Default: True, nothing is
        partitioned."""
        return True

    def host_state_bytes(self) -> int:
        """Bytes this rank's model states take in host memory during a step, on a CPU device
        (the engine decides from it whether freed host memory goes back to the system). Default:
        the model states it holds now (:meth:`memory`)."""
        return sum(self.memory().values())

    def offload_states(self, include: Any, device: Any, pin_memory: bool, non_blocking: bool) -> None:
        """Move this rank's training states (those of the kinds in ``include``, all when None) off
        the device until :meth:`reload_states` (``engine.offload_states``, DeepSpeed's call; the
        ZeRO stages do it in :mod:`zkit.zero.offload_states`). Default: refused."""
        raise NotImplementedError(f"engine.offload_states(): the partitioner {type(self).__name__} cannot move "
                                  f"its states off the device")

    def reload_states(self, non_blocking: bool) -> None:
        """Bring back what :meth:`offload_states` moved. Default: nothing was moved."""

    def offloaded_states(self) -> list[str]:
        """The kinds of state held off the device now (the engine refuses to run while there are
        any). Default: none."""
        return []

    def no_sync_allowed(self) -> bool:
        """Whether ``engine.no_sync()`` may skip gradient reduction for this partitioner."""
        return True

    def close(self) -> None:
        """Remove hooks and free buffers."""

    # -- helpers shared by stages ---------------------------------------------------------------
    def named_trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The module's trainable parameters, each once (tied parameters appear once)."""
        seen: set[int] = set()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield name, p
