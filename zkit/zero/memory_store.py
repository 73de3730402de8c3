"""The fp32 master kept in memory beside the model: the :class:`~zkit.core.stores.MasterStore` a ZeRO
partitioner uses when its allocator provides none (every stage, and stages 2-3 without
zkit-offload's NVMe store).

Here the master shards are tensors the optimizer steps in place: its parameters are views of them,
a checkpoint reads and writes them directly (:meth:`InMemoryMasterStore.read_master` gives the
shard itself, not a copy), and fp32 training with the master on the training device makes the
parameters' own shards the master (``master_is_param``: no copy at all). The gradients stay where
the stage keeps them (full buffers at stages 0-1, reduced shards at stages 2-3), read at the step.
The step is the fast one: with a fused optimizer a single pass unscales and clips the gradients,
updates the master and, with 16-bit parameters in host memory, writes them too (copy-out).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol, Sequence

import torch

from zkit.core.allocator import Allocator
from zkit.core.partitioner import PartitionContext
from zkit.optim import FusedStepOptimizer


def takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's with a fused kernel, which takes ``grad_scale`` and
    ``found_inf`` (as from ``GradScaler``) and so scales and skips on the device."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
            and bool(optimizer.defaults.get("fused")))


def fuses(optimizer: Any) -> bool:
    """Whether ``optimizer`` runs the fused step (unscale x clip factor, update, copy-out)."""
    return isinstance(optimizer, FusedStepOptimizer) and optimizer.fuses


def split_pieces(owned: Sequence[tuple[Any, ...]], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each owned piece's range ``[a, b)`` of its unit's tensor in ``grads``, in ``owned``'s order:
    one ``split`` per unit (a single op, views all) instead of a slice per piece, which on a GPU
    is a dispatch per parameter and step."""
    by_unit: dict[int, list[tuple[int, int, int]]] = {}
    for index, (_, u, a, b, _) in enumerate(owned):
        by_unit.setdefault(u, []).append((a, b, index))
    views: list[torch.Tensor | None] = [None] * len(owned)
    for u, ranges in by_unit.items():
        sizes, where, pos = [], [], 0
        for a, b, index in sorted(ranges):
            if a > pos:
                sizes.append(a - pos)  # a gap no piece of this rank covers
            where.append((len(sizes), index))
            sizes.append(b - a)
            pos = b
        numel = grads[u].numel()
        if pos < numel:
            sizes.append(numel - pos)
        parts = [grads[u]] if len(sizes) == 1 else grads[u].split(sizes)
        for part, index in where:
            views[index] = parts[part]
    return views  # type: ignore[return-value]


class MasterOwner(Protocol):
    """What the in-memory store uses of the ZeRO partitioner that owns it
    (:class:`~zkit.zero.zero_partitioner.ZeroPartitioner`): public members only."""

    ctx: PartitionContext
    #: its copies (side stream) and, where the allocator keeps optimizer state elsewhere, the stepper
    allocator: Allocator

    @property
    def master_device(self) -> torch.device: ...

    def reduced_grad_shards(self) -> list[torch.Tensor]:
        """Per unit, this rank's reduced gradient shard (padding included, zero)."""

    def publish_target(self, unit: int) -> torch.Tensor | None:
        """Where :meth:`publish_unit` writes ``unit``'s master (``None``: not in memory)."""

    def publish_unit(self, unit: int, master: torch.Tensor) -> None:
        """Copy ``unit``'s updated master into the parameters, without waiting for the copy."""

    @property
    def keeps_grad_buffers(self) -> bool:
        """Whether :meth:`reduced_grad_shards` gives the same tensors every step (their memory
        comes and goes between steps), so views of them may be kept."""


class InMemoryMasterStore:
    """The master shards ``master`` (one tensor per unit) of ``owner``, in memory.

    Args:
        owner: the partitioner (:class:`MasterOwner`): its reduced gradient shards, its allocator
            (copies, the optimizer stepper) and where it publishes a unit's master.
        master: per unit, this rank's fp32 master shard (the parameters' shards themselves when
            ``master_is_param``).
        master_is_param: the parameters are the master: nothing to copy either way.
    """

    #: the stage keeps its gradients itself (:attr:`zkit.core.stores.MasterStore.takes_grads`)
    takes_grads = False
    #: it is the partitioner's own store: its master is the parameters where it can be already
    shares_buffers = False

    def __init__(self, owner: MasterOwner, master: list[torch.Tensor], master_is_param: bool) -> None:
        self.owner = owner
        self.master = master
        self.master_is_param = master_is_param
        #: the optimizer's step writes the 16-bit parameters itself (see :meth:`bind`)
        self.copy_out = False
        #: where a step on the host reads the device's verdict and clipping factor (beside the master)
        self.host_flag: torch.Tensor | None = None
        #: (the unit gradients, each owned piece's view of them), kept while they are the same tensors
        self._grad_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def share_master(self, shards: Sequence[torch.Tensor]) -> None:
        raise RuntimeError("the in-memory master store does not share buffers (shares_buffers is False)")

    def add_grad_in_place(self, unit: int, grads: Sequence[torch.Tensor | None]) -> None:
        raise RuntimeError("the in-memory master store reads the stage's gradients; it takes none")

    # -- the master ------------------------------------------------------------------------------
    def write_master(self, unit: int, values: torch.Tensor) -> None:
        # a view of the shard itself (the parameters when they are the master, or what
        # read_master gave) is the same memory: copy_ returns at once
        self.master[unit].copy_(values)

    def read_master(self, unit: int) -> torch.Tensor:
        """The shard itself (no copy): writes to it are the master's."""
        return self.master[unit]

    # -- gradients -------------------------------------------------------------------------------
    def add_grad(self, unit: int, grad: torch.Tensor) -> None:
        raise RuntimeError("the in-memory master store takes no gradients: the ZeRO stage keeps its own")

    def _grads(self) -> list[torch.Tensor]:
        return self.owner.reduced_grad_shards()

    def grad_norm_sq(self) -> torch.Tensor:
        """On the training device (no wait for the host)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.owner.ctx.device)
        for g in self._grads():
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(sq.device) ** 2
        return sq

    def grads_finite(self) -> torch.Tensor:
        """On the gradients' device (no wait for the host): one fused read pass over the whole
        shards (their padding is zero), not one reduction per owned piece. A NaN or infinity
        makes a shard's L2 norm non-finite, and so do squares past fp32's range (Adam's second
        moment would square such gradients to inf too, and the norm for clipping overflows alike).
        L2, not L1: torch's CPU kernel vectorises the sum of squares, 4x as fast as the sum of
        absolute values (1.3 against 5.3 ms for 5M fp32 elements on one thread); in the shards'
        own dtype (the kernels accumulate bf16 in fp32: 0.14 against 0.55 ms for 1.2M elements
        converted first), fp32 for fp16, whose range is too small for the result."""
        shards = [g for g in self._grads() if g.numel()]
        if not shards:
            return torch.tensor(True, device="cpu")
        dtype = torch.float32 if any(g.dtype == torch.float16 for g in shards) else None
        norms = torch._foreach_norm(shards, 2, dtype=dtype)
        total = norms[0] if len(norms) == 1 else torch.stack(norms).sum()
        return total.lt(math.inf)  # torch.isfinite in 1 op, not 4: a norm is NaN, infinite or >= 0

    def zero_grad(self) -> None:
        """Nothing held: the stage frees its gradients."""

    def skip_step(self) -> None:
        """Nothing applied before the step: skipping is free."""

    # -- the step --------------------------------------------------------------------------------
    def bind(self, optimizer: torch.optim.Optimizer, owned: Sequence[tuple[Any, ...]]) -> None:
        """With a fused host optimizer and 16-bit parameters in host memory (CPU offload on a CPU,
        or parameters offloaded at stage 3), let the step write each owned piece's parameters in its
        own pass: all pieces or none."""
        if self.master_is_param or not fuses(optimizer) or self.owner.allocator.optimizer_stepper() is not None:
            return
        self.copy_out = attach_copy_outs(optimizer, owned, self.owner.publish_target)

    def _master_grads(self) -> list[torch.Tensor]:
        shards = self._grads()
        if self.master_is_param:
            # fp32 training: the shards are fp32 unless data_types.grad_accum_dtype made them 16-bit,
            # and the fp32 master (the parameters) takes only an fp32 .grad
            return [g if g.dtype == torch.float32 else g.float() for g in shards]
        # To the master's memory and fp32: on the side stream, a bounded number at a time, while
        # the next ones are issued; the step reads them on the host once each has landed.
        copies = self.owner.allocator.copies
        moved = [copies.to(g, self.owner.master_device, torch.float32) for g in shards]
        for _, copy in moved:
            copy.wait()
        return [g for g, _ in moved]

    def step(self, optimizer: torch.optim.Optimizer, owned: Sequence[tuple[Any, ...]],
             grad_factor: float | torch.Tensor, publish: Callable[[int, torch.Tensor], None],
             found_inf: torch.Tensor | None = None) -> bool:
        """Step on the master shards in place, then copy each unit's master into the parameters
        (unless they are the master, or the step wrote them). The masters are not reused, so the
        copies go out through the partitioner's ``publish_unit`` (no wait per unit) rather than
        ``publish``. ``found_inf`` (see :meth:`zkit.core.partitioner.Partitioner.step`) goes to
        a torch fused optimizer, which skips on the device; another optimizer reads it first.
        Returns False when the step was skipped on the host (nothing was published)."""
        grads = self._master_grads()
        # An allocator that keeps optimizer state elsewhere (NVMe) runs the step around its swaps.
        stepper = self.owner.allocator.optimizer_stepper()
        fused = stepper is None and fuses(optimizer)
        on_device = stepper is None and not fused and takes_found_inf(optimizer)
        if found_inf is not None and not on_device:
            if self._read_on_host(found_inf):
                return False
            found_inf = None
        if not on_device and torch.is_tensor(grad_factor):
            grad_factor = self._read_on_host(grad_factor)
        # a tensor factor goes into the fused kernel; a number scales the gradients first
        scaled_by_kernel = fused or torch.is_tensor(grad_factor)
        if not scaled_by_kernel and grad_factor != 1.0:
            for g in grads:
                g.mul_(grad_factor)
        for (opt_param, *_), grad in zip(owned, self._piece_grads(owned, grads)):
            opt_param.grad = grad
        if fused:  # one pass: unscale x clip factor, update, 16-bit copy-out
            optimizer.fused_step(grad_factor=grad_factor)
        elif stepper is not None:
            stepper(optimizer)
        elif on_device:  # torch's fused kernel divides by grad_scale and skips on found_inf
            scale = grad_factor.reciprocal() if torch.is_tensor(grad_factor) else None
            optimizer.grad_scale = scale  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        else:
            optimizer.step()
        for opt_param, *_ in owned:
            opt_param.grad = None
        if not (self.copy_out or self.master_is_param):
            for unit, master in enumerate(self.master):
                self.owner.publish_unit(unit, master)
        return True

    def _piece_grads(self, owned: Sequence[tuple[Any, ...]], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each owned piece's gradient, a view of its unit's: made once where the partitioner
        keeps its gradient buffers and the master is the parameters (the gradients stepped are
        those buffers), else at every step."""
        if self._grad_views is not None and len(grads) == len(self._grad_views[0]) and all(
                g is h for g, h in zip(grads, self._grad_views[0])):
            return self._grad_views[1]
        views = split_pieces(owned, grads)
        if self.master_is_param and self.owner.keeps_grad_buffers:
            self._grad_views = (list(grads), views)
        return views

    def _read_on_host(self, value: torch.Tensor) -> float:
        """A device value the host step needs, read into :attr:`host_flag`'s memory (where the
        master is on the host, after the wait for the gradients' copies)."""
        if self.host_flag is None or self.host_flag.device != self.owner.master_device:
            self.host_flag = torch.zeros((), dtype=torch.float32, device=self.owner.master_device)
        self.host_flag.copy_(value)
        return self.host_flag.item()


def attach_copy_outs(optimizer: Any, owned: Sequence[tuple[Any, ...]],
                     target: Callable[[int], torch.Tensor | None]) -> bool:
    """Let a fused host optimizer's step write each owned piece's 16-bit parameters in its own pass
    (``optimizer.attach_copy_out``), for all pieces or none: only where every piece's unit has a
    16-bit ``target(unit)`` in host memory. Whether it attached any."""
    twins = []
    for opt_param, u, a, b, _ in owned:
        where = target(u)
        if where is None or where.device.type != "cpu" or where.dtype not in (torch.float16, torch.bfloat16):
            return False
        twins.append((opt_param, where[a:b]))
    for opt_param, twin in twins:
        optimizer.attach_copy_out(opt_param, twin)
    return bool(twins)
