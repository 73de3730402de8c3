"""Collectives for training scripts: ``torch.distributed``'s functions under DeepSpeed's names
(``deepspeed.comm``), so ``import deepspeed.comm as dist`` and ``dist.get_rank()`` work as in a
DeepSpeed script.

Every function runs the ``torch.distributed`` collective on the same process group the engine
trains on; ``init_distributed`` joins it the way the engine does (torchrun's environment, or a
world of one process without it). Plugins do not use this module: they talk to the
:class:`zkit.core.communicator.Communicator` the stack gives them, which counts bytes and may compress.

Differences from DeepSpeed's module, each on purpose: there is no MPI discovery (ranks come from
``zkit run``/torchrun's environment), and the communication logger (``prof=``, ``log_name=``)
is accepted and ignored: ``zkit.torch_distributed.diagnostics`` times collectives instead.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as _dist

from zkit.core.distributed import default_backend, ensure_initialized

ReduceOp = _dist.ReduceOp
P2POp = _dist.P2POp
ProcessGroup = _dist.ProcessGroup

#: DeepSpeed's default port for the rendezvous when none is set
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
#: DeepSpeed's default timeout for collectives
default_pg_timeout = datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", 30)))

__all__ = [
    "ProcessGroup", "P2POp", "ReduceOp", "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single", "allgather_fn", "barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "default_pg_timeout", "destroy_process_group",
    "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank", "get_rank", "get_world_group",
    "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce",
    "init_distributed", "irecv", "is_available", "is_initialized", "isend", "log_summary", "monitored_barrier",
    "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter",
    "send",
]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta = default_pg_timeout,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the default process group, as ``deepspeed.init_distributed``: a no-op when it is
    already initialised; from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) or ``init_method``/``rank``/``world_size`` when given; a world of this one
    process when neither is there. ``dist_init_required=False`` asserts it is initialised."""
    if _dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False): the process group is not initialised; "
                           "initialise it first or pass dist_init_required=True")
    backend = dist_backend or default_backend()
    if init_method is not None or rank >= 0:
        kwargs: dict[str, Any] = {"timeout": timeout, "init_method": init_method or "env://"}
        if rank >= 0:
            kwargs.update(rank=rank, world_size=world_size)
        _dist.init_process_group(backend, **kwargs)
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    ensure_initialized(timeout.total_seconds())


def is_initialized() -> bool:
    return _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    _dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return _dist.new_group(ranks)


def get_world_group() -> Any:
    return _dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return _dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's ``LOCAL_RANK``."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group or _dist.group.WORLD, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return _dist.get_process_group_ranks(group or _dist.group.WORLD)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_logging: Any) -> Any:
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False, **_logging: Any) -> Any:
    return _dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_logging: Any) -> Any:
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None,
                          **_logging: Any) -> Any:
    return _dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               **_logging: Any) -> Any:
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, **_logging: Any) -> Any:
    return _dist.all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **_logging: Any) -> Any:
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               **_logging: Any) -> Any:
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj: Any, group: Any = None, **_logging: Any) -> Any:
    return _dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **_logging: Any) -> Any:
    return _dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, **_logging: Any) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False, **_logging: Any) -> Any:
    return _dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, **_logging: Any) -> Any:
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, **_logging: Any) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False,
                      **_logging: Any) -> Any:
    return _dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                   async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False, **_logging: Any) -> Any:
    return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Any = None, dst: int = 0, group: Any = None, async_op: bool = False,
           **_logging: Any) -> Any:
    return _dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Any = None, src: int = 0, group: Any = None,
            async_op: bool = False, **_logging: Any) -> Any:
    return _dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return _dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return _dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return _dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_logging: Any) -> Any:
    return _dist.irecv(tensor, src, group=group, tag=tag)


def batch_isend_irecv(p2p_op_list: list, **_logging: Any) -> Any:
    return _dist.batch_isend_irecv(p2p_op_list)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """DeepSpeed's communication-logger summary. zkit keeps no such log (``zkit.torch_distributed.diagnostics``
    times collectives per phase instead): an empty summary."""
    return {} if return_dict else None
