"""Gradients written in place (``zkit/zero/grad_buffers.py``): at stages 0-1, and at stages 2-3 on
one replica, every parameter's ``.grad`` is a view of its unit's flat buffer, so autograd
accumulates into it and nothing is copied per parameter; the training is the same."""
from __future__ import annotations

import pytest
import torch

from zkit.testing import run_ranks

import engine_ranks as er


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _where_gradients_are(stage: int, gas: int) -> dict:
    """Rank function: after each backward of a batch, whether every parameter's ``.grad`` lies in
    the memory of the partitioner's gradient shards; after the step, whether any is left and
    whether the shards still hold memory."""
    import zkit

    world = torch.distributed.get_world_size()
    cfg = er.config(stage, "fp32", gas, world)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zkit.initialize(model=er.make_model(), config=cfg)
    ids, labels = er.global_batches(2, gas, world)
    part = engine.partitioner
    params = list(engine.module.parameters())
    in_shards, shard_memory = [], []
    for step in range(2):
        for m in range(gas):
            first = ((step * gas + m) * world + engine.rank) * 2
            engine.backward(engine(ids[first : first + 2], labels[first : first + 2]))
            shards = part.reduced_grad_shards()
            ptrs = {s.untyped_storage().data_ptr() for s in shards}
            in_shards.append([p.grad is not None and p.grad.untyped_storage().data_ptr() in ptrs for p in params])
            engine.step()
        held = part.grad_shards if stage >= 2 else part.grad_bufs
        shard_memory.append(sum(t.untyped_storage().nbytes() for t in held))
    left = [p.grad is not None for p in params]
    engine.close()
    return {"in_shards": in_shards, "left": left, "shard_memory": shard_memory}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_at_one_replica_every_gradient_is_a_view_of_its_shard(stage):
    (out,) = run_ranks(_where_gradients_are, 1, args=(stage, 2), timeout=300)
    assert all(all(flags) for flags in out["in_shards"]), out["in_shards"]
    assert not any(out["left"]) and out["shard_memory"] == [0, 0]


def test_at_two_replicas_stage_2_reduces_through_its_buckets():
    for out in run_ranks(_where_gradients_are, 2, args=(2, 2), timeout=300):
        # each gradient leaves for its bucket as its unit is reduced: none is left in .grad
        assert not any(any(flags) for flags in out["in_shards"]) and not any(out["left"])


def _one_replica(cases: list[tuple[int, str, int]], clip: float) -> dict:
    """Rank function: ``er.stage_matrix`` with ``gradient_clipping`` (stage 3: nothing persistent)."""
    import zkit

    out = {}
    for stage, dtype, gas in cases:
        extra = {"gradient_clipping": clip} if clip else {}
        cfg = er.config(stage, dtype, gas, 1, **extra)
        if stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engine, *_ = zkit.initialize(model=er.make_model(), config=cfg)
        losses = er.train_engine(engine, 3, gas, 1)
        out[(stage, dtype, gas)] = (er.params_of(engine), losses)
        engine.close()
    return out


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_one_replica_stages_2_and_3_match_single_process_torch(clip):
    cases = [(stage, "fp32", gas) for stage in (2, 3) for gas in (1, 3)]
    (out,) = run_ranks(_one_replica, 1, args=(cases, clip), timeout=600)
    for stage, _, gas in cases:
        assert _max_diff(out[(stage, "fp32", gas)][0], er.reference(3, gas, 1, clip=clip)) < 1e-5, (stage, gas)


def test_one_replica_bf16_stages_2_and_3_equal_stage_0():
    # one replica: the same gradients in the same buffers, the same step
    cases = [(stage, dtype, 3) for stage in (0, 2, 3) for dtype in ("bf16", "fp16")]
    (out,) = run_ranks(_one_replica, 1, args=(cases, 0.0), timeout=600)
    for dtype in ("bf16", "fp16"):
        base_params, base_losses = out[(0, dtype, 3)]
        for stage in (2, 3):
            params, losses = out[(stage, dtype, 3)]
            assert losses == base_losses and _max_diff(params, base_params) == 0, (stage, dtype)


def _one_replica_gradient_paths(stage: int) -> dict:
    """Rank function (one rank): whether any parameter carries a post-accumulate hook, then 3
    steps whose middle one's gradients come from a backward outside the engine's (after
    ``zero_grad(set_to_none=True)``) and from a second micro-step whose ``.grad`` the user replaced,
    against single-process torch."""
    import zkit

    engine, *_ = zkit.initialize(model=er.make_model(), config=er.config(stage, "fp32", 2, 1))
    hooked = any(p._post_accumulate_grad_hooks for p in engine.module.parameters())
    ids, labels = er.global_batches(3, 2, 1)
    for step in range(3):
        for m in range(2):
            first = (step * 2 + m) * 2
            loss = engine(ids[first : first + 2], labels[first : first + 2])
            if step == 1 and m == 0:  # a backward outside the engine's, into fresh gradients
                engine.module.zero_grad(set_to_none=True)
                (loss / 2).backward()
            elif step == 1:  # the engine's, into gradients the user replaced by equal copies
                for p in engine.module.parameters():
                    p.grad = p.grad.clone()
                engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()
    params = er.params_of(engine)
    engine.close()
    return {"hooked": hooked, "params": params}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_at_one_replica_no_parameter_is_hooked_and_replaced_gradients_are_taken_in(stage):
    # a post-accumulate hook per parameter is a call into Python per parameter and backward; at
    # one replica there is nothing to reduce, and the stage takes the gradients in at the end of
    # backward and at the step, whatever made them
    (out,) = run_ranks(_one_replica_gradient_paths, 1, args=(stage,), timeout=300)
    assert not out["hooked"]
    assert _max_diff(out["params"], er.reference(3, 2, 1)) < 1e-5
