"""ZeRO stage 3 with activation checkpointing and shared weights, on 2 gloo ranks.

Under stage 3 a checkpointed block's parameters are released after its forward and gathered again
twice in backward: once for the recomputation, once when the recomputed graph's backward needs
them. A parameter shared by two checkpointed regions, or tied between a checkpointed region and
the head, must still get one correctly reduced gradient.
"""
from __future__ import annotations

import torch
from torch import nn

import zkit.activations.recompute as ckpt
from zkit.testing import run_ranks

import engine_ranks as er
from shared_models import SharedNet

STEPS = 3


def _stage3_config(world: int, dtype: str = "fp32") -> dict:
    cfg = er.config(3, dtype, 1, world)
    # every unit released after use, small prefetch: the most gathering and releasing
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100)
    return cfg


def _embed_mix_norm(name: str, module: nn.Module) -> bool:
    return name in ("embed", "mix", "norm")


#: label -> checkpoint policy for TiedNet
POLICIES = {"none": None, "linear": "type:Linear", "embed_mix_norm": _embed_mix_norm}


def tied_net_rank(names: list[str]) -> dict:
    """engine_ranks.TiedNet (embedding tied to the head, ``mix`` called twice) with its modules
    checkpointed by each policy, trained at stage 3."""
    import zkit

    world = torch.distributed.get_world_size()
    out = {}
    for name in names:
        ckpt.reset()
        model = er.make_model()
        wrapped = ckpt.apply(model, POLICIES[name]) if POLICIES[name] is not None else []
        engine, *_ = zkit.initialize(model=model, config=_stage3_config(world))
        ckpt.configure(engine, profile=True)  # counts each region's forward calls and recomputations
        losses = er.train_engine(engine, STEPS, 1, world)
        out[name] = (er.params_of(engine), losses, wrapped, ckpt.profile_report())
        engine.close()
    ckpt.reset()
    return out


def shared_blocks_rank() -> dict:
    """SharedNet with dropout at stage 3: no checkpointing, every block checkpointed, and
    every block checkpointed with its saved input in host memory (``cpu_checkpointing``)."""
    import zkit

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ids = torch.randint(0, 32, (STEPS, world * 2, 8), generator=torch.Generator().manual_seed(11))
    out = {}
    for mode in ("plain", "checkpointed", "cpu_checkpointing"):
        ckpt.reset()
        model = SharedNet()
        if mode != "plain":
            ckpt.apply(model, "every")
        cfg = _stage3_config(world)
        cfg["activation_checkpointing"] = {"cpu_checkpointing": mode == "cpu_checkpointing"}
        engine, *_ = zkit.initialize(model=model, config=cfg)
        losses, host_bytes = [], 0
        for step in range(STEPS):
            torch.manual_seed(100 + step * world + rank)  # dropout differs per rank, same across runs
            batch = ids[step, rank * 2 : rank * 2 + 2]
            loss = engine(batch, batch)
            host_bytes = max(host_bytes, engine.memory().get("activation_bytes", 0))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[mode] = (er.params_of(engine), losses, host_bytes)
        engine.close()
    ckpt.reset()
    return out


def _max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def test_tied_net_checkpointed_at_stage3_matches_torch():
    # "mix" runs twice per forward: its weight is used by two checkpointed regions; the embedding
    # is checkpointed while its weight is also the (unchecked) head.
    results = run_ranks(tied_net_rank, 2, args=(list(POLICIES),), timeout=240)
    reference = er.reference(STEPS, 1, 2)
    for r in results:
        for name in POLICIES:
            params, losses, wrapped, profile = r[name]
            assert _max_diff(params, reference) < 1e-5, name
        assert r["none"][2] == [] and r["linear"][2] == ["mix"] and r["embed_mix_norm"][2] == ["embed", "mix", "norm"]
        # every region really ran checkpointed: "mix" twice per step, each call recomputed once
        assert r["linear"][3]["mix"]["calls"] == r["linear"][3]["mix"]["recomputes"] == 2 * STEPS
        assert {k: v["recomputes"] for k, v in r["embed_mix_norm"][3].items()} == {"embed": STEPS, "mix": 2 * STEPS, "norm": STEPS}
    assert _max_diff(results[0]["embed_mix_norm"][0], results[1]["embed_mix_norm"][0]) == 0


def test_shared_weights_with_dropout_at_stage3_match_unchecked():
    results = run_ranks(shared_blocks_rank, 2, timeout=240)
    for r in results:
        plain = r["plain"]
        for mode in ("checkpointed", "cpu_checkpointing"):
            assert r[mode][1] == plain[1], mode  # identical losses: dropout recomputed identically
            assert _max_diff(r[mode][0], plain[0]) < 1e-6, mode
        # with cpu_checkpointing each of the 3 blocks keeps its (2, 8, 16) fp32 input on the host
        assert r["checkpointed"][2] == 0 and r["cpu_checkpointing"][2] == 3 * 2 * 8 * 16 * 4
    assert _max_diff(results[0]["checkpointed"][0], results[1]["checkpointed"][0]) == 0
