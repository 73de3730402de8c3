"""The torch communicator's collectives while Dynamo traces (``torch.compile``): blocking
torch.distributed calls that Dynamo rewrites into its functional collectives, so a compiled forward
or backward keeps them in its graph instead of breaking it (zkit-pipeline's tensor-parallel layers
issue theirs from inside the model).

What eager mode does around a collective and this path leaves out, and why that is acceptable:

* the byte counters (:meth:`~zkit.core.communicator.Communicator.account`): Dynamo would turn the
  counts into guards and recompile at every step; a collective inside a compiled graph is not
  counted in ``comm_stats()`` (the engine's own reductions and the optimizer's stay eager and
  counted);
* the fingerprint of each collective (:mod:`zkit.torch_distributed.diagnostics`): it reads the
  phase and builds an attrs object, which Dynamo cannot trace. A failure inside a compiled graph
  is raised as torch reports it, without the cross-rank report; the fingerprints of the eager
  collectives around it (the engine's reductions) still say where each rank was;
* asynchronous handles: Dynamo traces only blocking collectives (its compiler may still overlap
  them with computation); the result is ready when the call returns.

The numbers are those of the eager path: the same backend collective over the same group, with
``avg`` as sum-then-divide where the backend lacks it, as eagerly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zkit.torch_distributed import collectives
from zkit.torch_distributed.collectives import FlatCollectives

def tracing() -> bool:
    """Whether Dynamo is tracing this call (then the collectives below stand in for eager ones)."""
    return torch.compiler.is_compiling()


def all_reduce(tensor: torch.Tensor, op: str, group: Any, world_size: int, flat: FlatCollectives) -> None:
    backend_op, divide = flat.reduce_op(op)
    dist.all_reduce(tensor, op=backend_op, group=group)
    if divide:
        tensor.div_(world_size)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: Any, world_size: int,
                   flat: FlatCollectives) -> None:
    backend_op, divide = flat.reduce_op(op)
    collectives.reduce_scatter_flat(output, input, op=backend_op, group=group)
    if divide:
        output.div_(world_size)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    collectives.all_gather_flat(output, input, group=group)
