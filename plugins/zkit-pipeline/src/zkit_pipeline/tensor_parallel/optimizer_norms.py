"""Whole-parameter norms for an optimizer that needs them (LAMB's trust ratio) on a model sliced
over the tensor axis.

Each tensor rank holds a slice of a column- or row-parallel weight, so a norm over its own
parameters is the slice's. At engine set-up, an optimizer that is not elementwise is told which
parameters are sliced (``tensor_parallel = True``) and how to sum over the tensor group
(``set_sliced_norms``, see :class:`zkit.optim.lamb.Lamb`); one that cannot be told is refused.
ZeRO's pieces over the data-parallel ranks are summed by the optimizer's own shard norms first.
"""
from __future__ import annotations

from typing import Any

import torch


def configure(engine: Any, tensor_comm: Any, tensor_degree: int) -> None:
    """Give ``engine``'s optimizer the tensor group's norms (summed through ``tensor_comm``), or
    refuse a non-elementwise optimizer that has no ``set_sliced_norms``. Nothing to do for an
    elementwise one."""
    partitioner = engine.partitioner
    record = getattr(getattr(partitioner, "ctx", None), "optimizer", None)
    optimizer = engine.optimizer
    set_sliced_norms = getattr(optimizer, "set_sliced_norms", None)
    if not callable(set_sliced_norms):
        if record is not None and not record.elementwise:
            raise ValueError(
                f"optimizer {record.name!r} is not elementwise (it needs whole-parameter norms) and cannot step "
                f"on parameters sliced by tensor parallelism over {tensor_degree} ranks: it has no "
                f"set_sliced_norms to sum its norms over the tensor group; use an elementwise optimizer "
                f"(Adam, AdamW, SGD) or no tensor parallelism"
            )
        return
    owned, param_of = getattr(partitioner, "owned", None), getattr(partitioner, "param_of", None)
    if owned is None or param_of is None:
        raise ValueError(
            f"optimizer {type(optimizer).__name__} with tensor parallelism needs to know which model parameter each "
            f"of its parameters is; partitioner {type(partitioner).__name__} does not say (no owned / param_of)"
        )
    model_index = {name: i for i, name in enumerate(param_of)}
    of_piece = {id(opt_param): model_index[piece.slot.name] for opt_param, _unit, _a, _b, piece in owned}
    # a rank owning nothing holds one empty placeholder that never steps: any index serves
    index = [of_piece.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]]
    sliced = [i for name, i in model_index.items() if getattr(param_of[name], "tensor_parallel", False)]
    device = engine.device

    def all_reduce(t: torch.Tensor) -> None:
        # Through the training device: the optimizer may step on the host (offload).
        on_device = t.to(device)
        tensor_comm.all_reduce(on_device, "sum")
        if on_device is not t:
            t.copy_(on_device)

    set_sliced_norms(index, len(model_index), sliced, all_reduce)
