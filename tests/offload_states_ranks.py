"""Rank functions for the offload_states / reload_states tests (module level: ranks are spawned)."""
from __future__ import annotations

import torch

import zkit
from zkit.zero.offload_states import OffloadStateTypeEnum, held

from engine_ranks import make_model

VOCAB = 13


def _config(stage: int, dtype: str, offload_optimizer: bool) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 40}  # several units, several storages
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    return ids, ids.roll(1, dims=1)


def train(stage: int, dtype: str, offload_optimizer: bool, round_trip: bool, include: list[str] | None) -> dict:
    """Four steps; with ``round_trip``, offload and reload the states after each. Returns the
    losses, and what the first offload moved and whether the storages were emptied."""
    engine, *_ = zkit.initialize(model=make_model(), config=_config(stage, dtype, offload_optimizer))
    losses, report = [], {}
    for step in range(4):
        loss = engine(*_batch(step, engine.rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if not round_trip:
            continue
        state_storages = [t.untyped_storage() for s in engine.optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t) and t.numel() > 1]
        engine.offload_states(include=include)
        if step == 0:
            moved = held(engine.partitioner)
            report = {
                "bytes": {k.value: moved.nbytes(k) for k in OffloadStateTypeEnum},
                "kinds": sorted(k.value for k in moved.kinds),
                "state_emptied": bool(state_storages) and all(s.nbytes() == 0 for s in state_storages),
                "param_emptied": all(p.untyped_storage().nbytes() == 0 for p in engine.module.parameters()
                                     if p.numel() > 0),
                "host_bytes_equal": sum(m.host.numel() for m in moved.moved) == moved.nbytes(),
                "shard_elements": sum(end - start for _, _, start, end, _ in engine.partitioner.owned),
            }
            try:
                engine(*_batch(step, engine.rank))
            except RuntimeError as exc:
                report["refused"] = str(exc)
            engine.offload_states(include=include)  # a second call moves nothing more
            report["second_call_same"] = held(engine.partitioner).nbytes() == moved.nbytes()
        engine.reload_states()
        if step == 0:
            report["after_reload"] = held(engine.partitioner).nbytes()
            report["state_restored"] = all(s.nbytes() > 0 for s in state_storages)
    engine.close()
    return {"losses": losses, **report}


def with_and_without(stage: int, dtype: str, offload_optimizer: bool, include: list[str] | None) -> dict:
    """:func:`train` without round trips, then with them, in the same ranks (one start-up)."""
    return {"plain": train(stage, dtype, offload_optimizer, False, include),
            "moved": train(stage, dtype, offload_optimizer, True, include)}
