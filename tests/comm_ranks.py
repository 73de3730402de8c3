"""Rank functions for the communicator tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank_input(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank


def flat_collectives(shard: int) -> dict:
    """all_gather and reduce_scatter of the torch communicator, in place and out of place."""
    from zkit.builtin.comm_torch import TorchCommunicator

    comm = TorchCommunicator()
    r, n = comm.rank, comm.world_size
    out: dict = {}
    gathered = torch.empty(n * shard)
    comm.all_gather(gathered, rank_input(r, shard))
    out["all_gather"] = gathered
    in_place = torch.zeros(n * shard)
    in_place[r * shard : (r + 1) * shard] = rank_input(r, shard)
    comm.all_gather(in_place, in_place[r * shard : (r + 1) * shard], async_op=True).wait()
    out["all_gather_in_place"] = in_place
    for op in ("sum", "avg", "max"):
        result = torch.empty(shard)
        comm.reduce_scatter(result, rank_input(r, n * shard), op)
        out[f"reduce_scatter_{op}"] = result
        flat = rank_input(r, n * shard)
        comm.reduce_scatter(flat[r * shard : (r + 1) * shard], flat, op, async_op=True).wait()
        out[f"reduce_scatter_{op}_in_place"] = flat[r * shard : (r + 1) * shard].clone()
    out["stats"] = comm.stats()
    comm.close()
    return out
