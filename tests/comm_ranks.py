"""Rank functions for the communicator tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank_input(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank


def flat_collectives(shard: int, flat: str | None = None) -> dict:
    """all_gather and reduce_scatter of the torch communicator, in place and out of place, then
    the same issued together under ``comm.coalesced()``; ``flat`` forces the flat collectives."""
    from zkit.torch_distributed.communicator import TorchCommunicator

    comm = TorchCommunicator(flat_collectives=flat)
    out: dict = {"kind": comm.flat.kind}
    r, n = comm.rank, comm.world_size
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
    gathers = [torch.empty(n * shard) for _ in range(3)]
    with comm.coalesced():
        handles = [comm.all_gather(g, rank_input(r, shard) + i, async_op=True) for i, g in enumerate(gathers)]
    for h in handles:
        h.wait()
    out["coalesced_all_gather"] = gathers
    reduced = [torch.empty(shard) for _ in range(2)]
    with comm.coalesced():
        handles = [comm.reduce_scatter(o, rank_input(r, n * shard) * (i + 1), "avg", async_op=True)
                   for i, o in enumerate(reduced)]
    for h in handles:
        h.wait()
    out["coalesced_reduce_scatter_avg"] = reduced
    out["misuse"] = []
    for misuse in (lambda: comm.all_gather(torch.empty(n), torch.ones(1)),
                   lambda: comm.all_gather(torch.empty(n), torch.ones(1), async_op=True).wait()):
        try:
            with comm.coalesced():
                misuse()
        except (ValueError, RuntimeError) as exc:
            out["misuse"].append(str(exc))
    comm.close()
    return out


def engine_runs(flats: list[str | None], steps: int = 2) -> dict:
    """Per forced flat collectives kind (``None``: the backend's), stage 2 (gathers after the step,
    batched; and overlapped with the next forward) and stage 3 (prefetched and persistent
    gathers): final parameters and losses."""
    return {flat: _engine_runs(flat, steps) for flat in flats}


def _engine_runs(flat: str | None, steps: int) -> dict:
    import zkit
    from zkit.torch_distributed.communicator import TorchCommunicator
    from zkit.core.records import CommunicatorRecord

    import engine_ranks as er

    record = CommunicatorRecord(name=f"torch-{flat}", factory=lambda group, config: TorchCommunicator(
        group, config, flat_collectives=flat), description="torch.distributed, flat collectives forced")
    world = torch.distributed.get_world_size()
    out = {}
    persistent = []
    for name, stage, zero in (("stage2", 2, {}), ("stage2_overlap", 2, {"overlap_param_gather": True}),
                              ("stage3", 3, {"stage3_param_persistence_threshold": 20,  # the LayerNorm stays gathered
                                             "stage3_prefetch_bucket_size": 100,
                                             # one unit a module: several units to prefetch and one persistent
                                             "stage3_gather_unit": "module"})):
        cfg = er.config(stage, "fp32", 1, world)
        cfg["zero_optimization"].update(zero)
        engine, *_ = zkit.initialize(model=er.make_model(), config=cfg, stack=zkit.Stack(communicator=record))
        kind = engine.comm.flat.kind
        if stage == 3:
            persistent = [su.module_name for su in engine.partitioner.sharded if su.persistent]
        losses = er.train_engine(engine, steps, 1, world)
        out[name] = {"params": er.params_of(engine), "losses": losses, "kind": kind, "persistent": persistent}
        engine.close()
    return out


def broadcast_into_expanded() -> str:
    """A broadcast into an expanded tensor (one element shown as eight) is refused on every rank."""
    from zkit.torch_distributed.communicator import TorchCommunicator

    comm = TorchCommunicator(None, None)
    try:
        comm.broadcast(torch.zeros(1).expand(8), src=0)
    except ValueError as exc:
        return str(exc)
    return "broadcast"
