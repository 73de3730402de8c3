"""Rank functions for the step-in-backward tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch

import zkit

import offload_ranks as orr


def sib_config(stage: int, dtype: str, world: int, nvme_root: str, step_in_backward: bool, gas: int = 1,
               param: str = "none") -> dict:
    """``offload_ranks.config`` on NVMe with ``step_in_backward`` and ``gas`` micro-batches of
    ``2 // gas`` rows per step (the same global batch for every ``gas``)."""
    cfg = orr.config(stage, dtype, world, "nvme", nvme_root, micro=2 // gas, param=param,
                     gradient_accumulation_steps=gas)
    cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = step_in_backward
    return cfg


def train_and_count(engine, steps: int, gas: int) -> dict:
    """Train ``steps`` batches; note after each backward that ends one whether its step began
    there, and the optimizer swapper's bytes over the steps after the first (the first creates
    the state)."""
    store = engine.partitioner.master_store
    swapper = engine.allocator.swapper
    began, counted = [], {}
    world, rank = engine.world_size, engine.rank
    micro = 2 // gas
    ids, labels = orr.global_batches(steps * gas, micro * world)
    losses = []
    for i in range(steps * gas):
        if i == gas:  # after the first step
            counted = {"written": swapper.bytes_written, "read": swapper.bytes_read}
        first = (i * world + rank) * micro
        loss = engine(ids[first : first + micro], labels[first : first + micro])
        engine.backward(loss)
        if (i + 1) % gas == 0:
            began.append(store.stepped_in_backward)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "began": began, "written": swapper.bytes_written - counted["written"],
            "read": swapper.bytes_read - counted["read"],
            "grad_bytes": sum(store.shard_sizes) * 4, "subgroup_bytes": sum(store.sizes) * 4}


def equivalence(cases: list[tuple[int, str, int, str]], nvme_root: str, steps: int = 3) -> dict:
    """Per (stage, dtype, gas, offload_param device), with and without step_in_backward: final
    parameters, losses, whether each step began in backward, and the optimizer swapper's bytes."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas, param in cases:
        for sib in (False, True):
            cfg = sib_config(stage, dtype, world, nvme_root, sib, gas, param)
            engine, *_ = zkit.initialize(model=orr.make_model(), config=cfg)
            result = train_and_count(engine, steps, gas)
            result["params"] = orr.params_of(engine)
            engine.close()
            out[(stage, dtype, gas, param, sib)] = result
    return out


def nonfinite_stops(nvme_root: str) -> str:
    """A NaN loss at the second step of a step-in-backward run: the error ``step()`` raises."""
    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=orr.make_model(), config=sib_config(2, "fp32", world, nvme_root, True))
    ids, labels = orr.global_batches(2, 2 * world)
    rank = engine.rank
    try:
        for step in range(2):
            first = (step * world + rank) * 2
            loss = engine(ids[first : first + 2], labels[first : first + 2])
            if step == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
    except FloatingPointError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"
