"""How the torch communicator runs its flat collectives on one backend, chosen once per
communicator (:func:`choose`): the only place that looks at the backend's name.

* ``"native"`` (NCCL and every backend but gloo): ``all_gather_single`` / ``reduce_scatter_single``
  (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before torch 2.13), asynchronous, batched
  into one launch under :meth:`TorchCommunicator.coalesced`; NCCL averages natively.
* ``"per_rank"`` (gloo): one broadcast (all-gather) or one reduce (reduce-scatter) per rank, which
  moves the same bytes and measured 2-3.4x (all-gather) and 1.3-2.3x (reduce-scatter) faster at
  5M-23M elements on 2-4 ranks (``contrib/bench/bench_gloo_collectives.py``); no batching. From 4
  ranks up, a reduce-scatter of fewer than :data:`NATIVE_REDUCE_SCATTER_PER_RANK` elements per
  rank goes out as gloo's own instead: its sequence of reduces, one per rank, then costs more than
  the one collective (on 4 ranks: 0.66-0.74x the time at 260K-1M elements, 1.38x at 2.1M; on 2
  ranks the reduces win at every size measured, from 260K).

gloo runs the native collectives too (torch 2.13), so tests force ``"native"`` on CPU and compare.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

KINDS = ("native", "per_rank")
#: zkit's reduce ops other than ``avg`` (``zkit.core.communicator.REDUCE_OPS``) -> the backend's
_BACKEND_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: ``per_rank`` on 4 ranks or more: reduce-scatters below this many elements per rank are native
NATIVE_REDUCE_SCATTER_PER_RANK = 384 * 1024


class AllDone:
    """One handle over several works issued together, then an optional finishing step."""

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            self.then()
            self.then = None


@attrs.frozen
class FlatCollectives:
    """The flat all-gather and reduce-scatter of one backend.

    Attributes:
        kind: ``"native"`` or ``"per_rank"``.
        native_avg: the backend reduces with ``ReduceOp.AVG`` (else: sum, then divide).
        native_reduce_scatter_below: with ``per_rank``, a reduce-scatter of fewer elements is
            the backend's own (0: never).
    """

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    native_avg: bool = False
    native_reduce_scatter_below: int = 0

    def reduce_op(self, op: str) -> tuple[Any, bool]:
        """The backend's reduce op for zkit's ``op``, and whether the result must still be divided
        by the group's size (``avg`` where the backend lacks it: a sum, then the division)."""
        if op == "avg":
            return (dist.ReduceOp.AVG, False) if self.native_avg else (dist.ReduceOp.SUM, True)
        return _BACKEND_OPS[op], False

    @property
    def coalesces(self) -> bool:
        """Whether collectives issued together go out as one batch."""
        return self.kind == "native"

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, rank: int, ranks: list[int], group: Any) -> Any:
        """Start the all-gather of ``input`` into ``output``; its work (or ``None`` in a batch)."""
        if self.kind == "native":
            return all_gather_flat(output, input, group=group, async_op=True)
        chunks = output.view(len(ranks), -1)
        own = chunks[rank]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        return AllDone([dist.broadcast(chunks[k], src=ranks[k], group=group, async_op=True) for k in range(len(ranks))])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any, rank: int, ranks: list[int],
                       group: Any) -> Any:
        """Start the reduce-scatter of ``input`` into ``output``; its work."""
        if self.kind == "native" or input.numel() < self.native_reduce_scatter_below:
            return reduce_scatter_flat(output, input, op=op, group=group, async_op=True)
        # The reduces work in place, so chunks of ``input`` that other ranks own end up undefined.
        chunks = input.view(len(ranks), -1)
        works = [dist.reduce(chunks[k], dst=ranks[k], op=op, group=group, async_op=True) for k in range(len(ranks))]
        own = chunks[rank]
        return AllDone(works, None if own.data_ptr() == output.data_ptr() else (lambda: output.copy_(own)))


def choose(backend: str, forced: str | None = None, world_size: int = 2) -> FlatCollectives:
    """The flat collectives for ``backend`` on ``world_size`` ranks (``forced``: ``"native"`` or
    ``"per_rank"`` for every size, whatever the backend, for tests and measurements)."""
    if forced is not None and forced not in KINDS:
        raise ValueError(f"flat collectives {forced!r}: choose one of {', '.join(KINDS)} (or None: by backend)")
    kind = forced or ("per_rank" if backend == "gloo" else "native")
    below = NATIVE_REDUCE_SCATTER_PER_RANK * world_size if forced is None and kind == "per_rank" and world_size >= 4 else 0
    return FlatCollectives(kind=kind, native_avg=backend == "nccl", native_reduce_scatter_below=below)
