"""Rank function of tests/test_offload_states_overlap.py (module level: ranks are spawned)."""
from __future__ import annotations

import zkit

from engine_ranks import make_model
from offload_states_ranks import _batch, _config


def train(round_trip: bool) -> dict:
    """Three ZeRO-2 steps with overlap_param_gather; with ``round_trip``, offload_states() and
    reload_states() right after each step, while the step's parameter all-gathers are in flight."""
    config = _config(2, "fp32", False)
    config["zero_optimization"]["overlap_param_gather"] = True
    engine, *_ = zkit.initialize(model=make_model(), config=config)
    losses, in_flight, left = [], [], []
    for step in range(3):
        loss = engine(*_batch(step, engine.rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if round_trip:
            in_flight.append(len(engine.partitioner.refresh.pending))
            engine.offload_states()
            left.append(len(engine.partitioner.refresh.pending))
            engine.reload_states()
    engine.wait_for_parameters()
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return {"losses": losses, "params": params, "in_flight": in_flight, "left": left}


def with_and_without() -> dict:
    return {"plain": train(False), "moved": train(True)}
