"""The memory estimator equals zkit's allocations for stages 0-3, and the GPT activation count
equals what autograd saves."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zkit.cli import main
from zkit.estimator.command import estimate_memory
from zkit.estimator import gpt_activation_bytes, model_state_bytes, stage3_units
from zkit.models.gpt import GPT, GPTConfig
from zkit.testing import run_ranks

import engine_ranks as er
from shared_models import saved_tensor_bytes

#: (stage, dtype, stage3_param_persistence_threshold): TiedNet's units are 12, 42 and 78 elements,
#: so 50 keeps the two smaller ones gathered
CASES = [(stage, dtype, 0) for stage in (0, 1, 2) for dtype in ("fp32", "bf16")]
CASES += [(3, dtype, persistence) for dtype in ("fp32", "bf16") for persistence in (0, 50)]


def memory_rank(cases):
    import zkit

    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, persistence in cases:
        cfg = er.config(stage, dtype, 1, world)
        # reuse distance 0: each unit released after its use, the tightest working set to check
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=persistence, stage3_prefetch_bucket_size=40,
                                        stage3_max_reuse_distance=0)
        engine, *_ = zkit.initialize(model=er.make_model(), config=cfg)
        er.train_engine(engine, 2, 1, world)
        out[(stage, dtype, persistence)] = {k[: -len("_bytes")]: v for k, v in engine.memory().items()
                                            if k.endswith("_bytes") and "rss" not in k}
        engine.close()
    return out


@pytest.mark.parametrize("world", (1, 2))
def test_estimate_equals_engine_memory(world):
    results = run_ranks(memory_rank, world, args=(CASES,), timeout=240)
    shapes = [(n, tuple(p.shape)) for n, p in er.make_model().named_parameters()]
    for rank, measured in enumerate(results):
        for stage, dtype, persistence in CASES:
            est = model_state_bytes(
                shapes, stage=stage, world_size=world, dtype=dtype, rank=rank, reduce_bucket_size=40,
                overlap_comm=True, accelerator=False, stage3_param_persistence_threshold=persistence,
                stage3_prefetch_bucket_size=40, stage3_max_reuse_distance=0,
            )
            got = {k: v for k, v in measured[(stage, dtype, persistence)].items() if not k.endswith("_peak")}
            assert est.host == {} and est.nvme == {}
            # between steps: the held buffers, exactly; gradients and buckets only during the step
            held = est.device_between_steps
            for purpose in set(got) | set(held):
                assert held.get(purpose, 0) == got.get(purpose, 0), (world, rank, stage, dtype, persistence, purpose)
            for purpose in ("grad", "bucket"):
                peak = measured[(stage, dtype, persistence)].get(f"{purpose}_peak", 0)
                assert est.device.get(purpose, 0) == peak, (world, rank, stage, dtype, persistence, purpose)
            if stage == 3 and world > 1:
                # during forward/backward: parameters gathered on top of the held ones
                peak = measured[(stage, dtype, persistence)]["param_peak"]
                assert got["param"] < peak <= held["param"] + est.device.get("gathered_param", 0), (world, persistence)


def test_stage3_units_are_one_per_module_in_reverse_order():
    shapes = [("embed.weight", (13, 6)), ("mix.weight", (6, 6)), ("mix.bias", (6,)), ("norm.weight", (6,)), ("norm.bias", (6,))]
    units = stage3_units(shapes, 4)
    assert [[s.name for s in u.slots] for u in units] == [["norm.weight", "norm.bias"], ["mix.weight", "mix.bias"], ["embed.weight"]]
    assert [(u.numel, u.padded) for u in units] == [(12, 12), (42, 44), (78, 80)]
    assert [u.index for u in units] == [0, 1, 2]


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    world=st.integers(1, 8),
    bucket=st.integers(1, 120),
    stage=st.sampled_from((1, 2)),
)
@settings(max_examples=60, deadline=None)
def test_shards_cover_the_model_once(sizes, world, bucket, stage):
    shapes = [(f"p{i}", (n,)) for i, n in enumerate(sizes)]
    per_rank = [
        model_state_bytes(shapes, stage=stage, world_size=world, dtype="fp32", rank=r, reduce_bucket_size=bucket)
        for r in range(world)
    ]
    assert sum(s.host["optim_state"] for s in per_rank if "optim_state" in s.host) == 0
    assert sum(s.device.get("optim_state", 0) for s in per_rank) == 8 * sum(sizes)
    padded = per_rank[0].device["param"] // 4
    units = -(-sum(sizes) // 1)  # at most one unit per parameter
    assert sum(sizes) <= padded <= sum(sizes) + min(units, len(sizes)) * (world - 1)
    assert len({s.device["param"] for s in per_rank}) == 1  # parameters are replicated


@given(
    modules=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=8),
    world=st.integers(1, 8),
    persistence=st.integers(0, 60),
)
@settings(max_examples=60, deadline=None)
def test_stage3_shards_cover_the_model_once(modules, world, persistence):
    shapes = [(f"m{i}.p{j}", (n,)) for i, sizes in enumerate(modules) for j, n in enumerate(sizes)]
    per_rank = [
        model_state_bytes(shapes, stage=3, world_size=world, dtype="fp16", rank=r,
                          stage3_param_persistence_threshold=persistence, stage3_gather_unit="module")
        for r in range(world)
    ]
    total = sum(map(sum, modules))
    padded = [-(-sum(sizes) // world) * world for sizes in modules]
    # one replica: a persistent unit's shard is its gathered buffer
    kept = sum(p for p, sizes in zip(padded, modules) if sum(sizes) <= persistence) if world > 1 else 0
    assert sum(s.device["optim_state"] for s in per_rank if "optim_state" in s.device) == 8 * total
    assert {s.device["param"] for s in per_rank} == {2 * (sum(padded) // world + kept)}
    assert {s.device["grad"] for s in per_rank} == {2 * sum(padded) // world}
    assert per_rank[0].device.get("gathered_param", 0) <= 2 * (sum(padded) - kept)


@pytest.mark.parametrize("dtype, nbytes", ((torch.float32, 4), (torch.bfloat16, 2)))
@pytest.mark.parametrize("checkpointing", (False, True))
def test_gpt_activation_estimate_matches_saved_tensors(dtype, nbytes, checkpointing):
    import zkit.activations.recompute as ckpt

    cfg = GPTConfig(vocab_size=200, seq_len=32, n_layer=3, n_head=4, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    if checkpointing:
        ckpt.apply(model, "every")
    ids = torch.randint(0, 200, (3, 32))
    measured = saved_tensor_bytes(model, ids)
    est = gpt_activation_bytes(cfg, 3, dtype_bytes=nbytes, checkpointing=checkpointing)["saved"]
    assert abs(est - measured) <= 0.01 * measured, (est, measured)


def test_checkpointing_estimate_is_smaller_and_peaks_one_block_higher():
    cfg = GPTConfig.preset("gpt2-124m")
    plain = gpt_activation_bytes(cfg, 8)
    ck = gpt_activation_bytes(cfg, 8, checkpointing=True)
    assert ck["saved"] < plain["saved"] / 2
    assert ck["peak"] - ck["saved"] == plain["per_block"]


def test_model_num_params_and_gpt_config_agree():
    cfg = GPTConfig.preset("small")
    with torch.device("meta"):
        model = GPT(cfg)
    a = estimate_memory(model, world_sizes=(2,))
    b = estimate_memory(gpt_config=cfg, world_sizes=(2,))
    assert a.num_params == b.num_params == cfg.num_parameters()
    assert a.rows == b.rows
    c = estimate_memory(num_params=cfg.num_parameters(), world_sizes=(2,))
    assert c.row(world_size=2, stage=1).states.device["param"] == 2 * (cfg.num_parameters() + cfg.num_parameters() % 2)


def test_offload_moves_master_and_state_to_host():
    e = estimate_memory(num_params=1000, world_sizes=(4,), dtypes=("fp16",))
    none, cpu = e.row(world_size=4, stage=2).states, e.row(world_size=4, stage=2, offload="cpu").states
    assert none.device["optim_state"] == 8 * 250 and "optim_state" not in cpu.device
    assert cpu.host == {"master": 4 * 250, "master_grad": 4 * 250, "optim_state": 8 * 250}
    assert not e.row(world_size=4, stage=2, offload="cpu+params").states.supported
    nvme = e.row(world_size=4, stage=3, offload="nvme").states
    # stages 2-3: master, gradients and state on disk, the 250-element shard padded to 4 KiB
    assert nvme.nvme == {"master": 4 * 1024, "master_grad": 4 * 1024, "optim_state": 8 * 1024}
    assert "grad" not in nvme.device and nvme.host["master_grad"] == 2 * 4 * 1024
    assert e.row(world_size=4, stage=1, offload="nvme").states.nvme == {"optim_state": 8 * 250}
    params3 = e.row(world_size=4, stage=3, offload="cpu+params").states
    # 1000 elements are under the default persistence threshold (1e5): the unit also stays gathered
    assert params3.host["param"] == 2 * (250 + 1000) and "param" not in params3.device
    big = estimate_memory(num_params=400_000, world_sizes=(4,), dtypes=("fp16",), reduce_bucket_size=200_000)
    released = big.row(world_size=4, stage=3).states
    assert released.device["param"] == 2 * 100_000 and released.device["grad"] == 2 * 100_000
    assert released.device["gathered_param"] == 2 * 400_000  # both 200K units fit the 50M prefetch


def test_table_and_cli(capsys):
    text = estimate_memory(gpt_config=GPTConfig.preset("tiny"), batch=2, world_sizes=(1, 2)).table()
    assert "world size 2" in text and "n/a (parameter offload needs stage 3)" in text
    assert "activations per micro-batch (batch 2, seq 64)" in text
    assert main(["estimate", "--params", "7e9", "--world-sizes", "8", "--stages", "3"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 parameters" in out and "world size 8" in out


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of model=, num_params= or gpt_config="),
        (dict(num_params=0), "num_params must be an int >= 1"),
        (dict(num_params=10, stages=(4,)), "stages must be chosen from 0, 1, 2, 3; got 4"),
        (dict(num_params=10, offloads=("disk",)), "offloads must be chosen from"),
        (dict(num_params=10, dtypes=("fp8",)), "dtypes must be chosen from"),
        (dict(num_params=10, world_sizes=(0,)), "world_sizes must be ints >= 1"),
        (dict(num_params=10, optimizer="rmsprop"), "unknown optimizer 'rmsprop'"),
        (dict(gpt_config=3), "gpt_config must be a zkit.models.gpt.GPTConfig"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        estimate_memory(**kwargs)


def test_activation_argument_errors():
    cfg = GPTConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"seq must be an int in \[1, 64\]"):
        gpt_activation_bytes(cfg, 2, 65)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        gpt_activation_bytes(cfg, 0)
    with pytest.raises(ValueError, match="attention must be one of flash, math"):
        gpt_activation_bytes(cfg, 1, attention="sparse")


def test_cli_errors():
    with pytest.raises(SystemExit, match="--params must be a whole number"):
        main(["estimate", "--params", "1.5"])
    with pytest.raises(SystemExit, match="--world-sizes takes comma-separated integers"):
        main(["estimate", "--params", "10", "--world-sizes", "a"])
    with pytest.raises(SystemExit, match="--model takes MODULE:CALLABLE"):
        main(["estimate", "--model", "zkit.models.gpt"])


def test_stage3_working_set_follows_the_reuse_distance(capsys):
    """At distance 0 stage 3 gathers the unit in use plus the prefetch window; a distance adds the
    units kept for their reuse (one more largest unit and the distance), capped at all units."""
    shapes = [(f"m{i}.weight", (100, 10)) for i in range(10)]  # ten 1000-element units

    def gathered(reuse: int) -> int:
        states = model_state_bytes(shapes, stage=3, world_size=2, dtype="fp32", stage3_param_persistence_threshold=0,
                                   stage3_prefetch_bucket_size=2000, stage3_max_reuse_distance=reuse,
                                   stage3_gather_unit="module")
        return states.device["gathered_param"] // 4

    assert gathered(0) == 1000 + 2000
    assert gathered(3000) == 1000 + 2000 + 1000 + 3000
    assert gathered(10**9) == 10 * 1000
    main(["estimate", "--params", "2e9", "--world-sizes", "4", "--stages", "3", "--offload", "none",
          "--dtypes", "fp16"])
    default = capsys.readouterr().out
    main(["estimate", "--params", "2e9", "--world-sizes", "4", "--stages", "3", "--offload", "none",
          "--dtypes", "fp16", "--stage3-max-reuse-distance", "0"])
    released = capsys.readouterr().out
    assert default != released  # the whole model gathered at 1e9, one unit and a window at 0
