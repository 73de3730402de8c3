"""Compressed collectives and 1-bit Adam on real gloo ranks, against single-process references.

Starting ranks dominates the cost, so each world size runs all its scenarios in one job."""
from __future__ import annotations

import pytest
import torch

from zkit.testing import run_ranks

import onebit_ranks
from onebit_reference import (
    simulate_all_reduce,
    simulate_onebit_adam,
    simulate_reduce_scatter,
    simulate_zero_one_adam,
)
from zkit_onebit.collectives import wire_bytes_all_reduce
from zkit_onebit.compression import ChunkLayout

TIMEOUT = 240
STEPS = 4
NUMEL = {2: 1001, 4: 4099}  # neither a multiple of 8 nor of the world size
RS_NUMEL = {2: 208, 4: 424}  # shards of 104 and 106: not multiples of 8
FREEZE, ADAM_STEPS = 5, 12
MASKED_NUMEL = 203
SYN_FREEZE, SYN_STEPS = 4, 12
ZO_STEPS = 24


ENGINE_RUNS = [(0, "fp32"), (1, "bf16"), (2, "fp16")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    save = tmp_path_factory.mktemp("onebit_ckpt")
    jobs = [
        *[(f"engine_{s}_{p}", "engine_run", (s, p, 3, 6)) for s, p in ENGINE_RUNS],
        ("engine_onebit_communicator", (4,)),
        *[(f"engine_ckpt_{s}", "engine_checkpoint_resume", (s, 3, 5, 3, str(save / f"s{s}"))) for s in (0, 2)],
        *[(f"engine_zo_{p}", "engine_run", (0, p, 4, 8, "ZeroOneAdam")) for p in ("fp32", "bf16")],
        ("engine_ckpt_zo", "engine_checkpoint_resume", (0, 3, 6, 4, str(save / "zo"), "ZeroOneAdam")),
        # Saved after the 1-bit gradient step 3, resumed into the variance step 4 (rescaled buffers).
        ("engine_ckpt_zo_var", "engine_checkpoint_resume", (0, 8, 3, 3, str(save / "zo_var"), "ZeroOneAdam")),
        ("compressed_all_reduce_steps", (NUMEL[2], STEPS)),
        ("compressed_reduce_scatter_steps", (RS_NUMEL[2], STEPS)),
        ("compressed_all_reduce_steps_bf16", (600, 2)),
        ("masked_all_reduce_steps", (MASKED_NUMEL, STEPS)),
        ("onebit_adam_synthetic", (SYN_FREEZE, SYN_STEPS, 0.01)),
        ("zero_one_adam_synthetic", (ZO_STEPS, 0.01)),
        ("onebit_adam_run", (FREEZE, ADAM_STEPS, 0.01)),
        ("checkpoint_resume", (3, 6, 5)),
        ("zero1_run", (3, 8)),
    ]
    return run_ranks(onebit_ranks.scenarios, 2, args=(jobs,), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks():
    jobs = [
        ("compressed_all_reduce_steps", (NUMEL[4], STEPS)),
        ("compressed_reduce_scatter_steps", (RS_NUMEL[4], STEPS)),
    ]
    return run_ranks(onebit_ranks.scenarios, 4, args=(jobs,), timeout=TIMEOUT)


@pytest.fixture(params=[2, 4])
def ranks(request):
    return request.param, request.getfixturevalue("two_ranks" if request.param == 2 else "four_ranks")


def test_compressed_all_reduce_matches_reference(ranks):
    world_size, all_results = ranks
    numel = NUMEL[world_size]
    results = [r["compressed_all_reduce_steps"] for r in all_results]
    layout = ChunkLayout.for_all_reduce(numel, world_size)
    worker = [torch.zeros(world_size, layout.chunk) for _ in range(world_size)]
    server = [torch.zeros(1, layout.chunk) for _ in range(world_size)]
    inputs = [onebit_ranks.rank_inputs(r, STEPS, numel) for r in range(world_size)]
    for step in range(STEPS):
        expected = simulate_all_reduce([inputs[r][step] for r in range(world_size)], worker, server)
        for r in range(world_size):
            # The same math with other reduction kernels: equal up to float rounding.
            torch.testing.assert_close(results[r]["outs"][step], expected, rtol=1e-5, atol=1e-6)
    for r in range(world_size):
        torch.testing.assert_close(results[r]["worker"], worker[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(results[r]["server"], server[r], rtol=1e-5, atol=1e-5)
    # Every rank decodes the same gathered packets: bit-identical results.
    for r in range(1, world_size):
        assert all(torch.equal(a, b) for a, b in zip(results[0]["outs"], results[r]["outs"]))


def test_compressed_all_reduce_wire_bytes(ranks):
    world_size, all_results = ranks
    numel = NUMEL[world_size]
    res = all_results[0]["compressed_all_reduce_steps"]
    sent = res["stats"]["all_reduce_1bit"]["bytes"]
    assert sent == STEPS * wire_bytes_all_reduce(numel, world_size)
    # What the 1-bit communicator reports is exactly what its transport moved.
    assert sum(v["bytes"] for v in res["transport"].values()) == sent
    assert set(res["transport"]) == {"all_to_all", "all_gather"}
    fp32 = STEPS * 2 * (world_size - 1) * numel * 4 / world_size
    assert fp32 / sent > 20  # small tensors; the large-tensor ratio (~31x) is in the benchmark


def test_compressed_reduce_scatter_matches_reference(ranks):
    world_size, all_results = ranks
    numel = RS_NUMEL[world_size]
    results = [r["compressed_reduce_scatter_steps"] for r in all_results]
    layout = ChunkLayout.for_reduce_scatter(numel, world_size)
    worker = [torch.zeros(world_size, layout.chunk) for _ in range(world_size)]
    inputs = [onebit_ranks.rank_inputs(r, STEPS, numel, seed=1) for r in range(world_size)]
    for step in range(STEPS):
        expected = simulate_reduce_scatter([inputs[r][step] for r in range(world_size)], worker)
        for r in range(world_size):
            torch.testing.assert_close(results[r]["outs"][step], expected[r], rtol=1e-5, atol=1e-6)


def test_compressed_all_reduce_bf16_tensors(two_ranks):
    a, b = (r["compressed_all_reduce_steps_bf16"]["outs"] for r in two_ranks)
    assert a[1].abs().sum() > 0
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_onebit_adam_warmup_is_adamw_bit_for_bit_then_replicas_stay_equal(two_ranks):
    results = [r["onebit_adam_run"] for r in two_ranks]
    for r in range(2):
        for step in range(FREEZE):
            assert torch.equal(results[r]["params"][step], results[r]["adamw"][step]), f"rank {r} step {step}"
    # After the freeze the momenta travel compressed: parameters leave AdamW's path, but every
    # rank applies the same update.
    for step in range(ADAM_STEPS):
        assert torch.equal(results[0]["params"][step], results[1]["params"][step])
    assert not torch.equal(results[0]["params"][-1], results[0]["params"][FREEZE - 1])
    stats = results[0]["stats"]
    assert stats["all_to_all"]["calls"] == ADAM_STEPS - FREEZE
    assert stats["all_gather"]["calls"] == ADAM_STEPS - FREEZE


def test_checkpoint_mid_compression_resumes_identically(two_ranks):
    for r in range(2):
        res = two_ranks[r]["checkpoint_resume"]
        assert res["frozen"]
        assert torch.equal(res["straight"], res["resumed"])


def test_zero1_compresses_the_gradient_reduce_scatter_after_freeze(two_ranks):
    freeze, steps = 3, 8
    for r in range(2):
        res = two_ranks[r]["zero1_run"]
        assert res["wrapped"]
        assert res["flags"] == [False] * (freeze - 1) + [True] * (steps - freeze + 1)
        assert res["stats"]["reduce_scatter"]["calls"] == freeze
        assert res["stats"]["reduce_scatter_1bit"]["calls"] == steps - freeze
    # Every rank gathered the same parameters.
    assert torch.equal(two_ranks[0]["zero1_run"]["flat"], two_ranks[1]["zero1_run"]["flat"])


@pytest.mark.parametrize("stage,precision", ENGINE_RUNS)
def test_engine_trains_with_onebit_adam(two_ranks, stage, precision):
    a, b = (r[f"engine_{stage}_{precision}"] for r in two_ranks)
    assert a["frozen"] and all(torch.isfinite(torch.tensor(a["losses"])))
    assert torch.equal(a["params"], b["params"]), "replicas diverged"
    stats = a["stats"]
    if stage == 0:
        # Warm-up (3 steps) all-reduces gradients; then the partitioner stops and momenta travel 1-bit.
        assert a["exchange"] == "momentum" and a["reduction"] == [True, True, False, False, False, False]
        # 3 gradient all-reduces; per step one more scalar: the agreed gradient norm when the
        # engine asks for it (fp16, clipping, logging), else, beside a gradient reduction, the
        # non-finite-loss flag.
        assert stats["all_reduce"]["calls"] in (3 + 3, 3 + 6) and stats["all_to_all"]["calls"] == 3
    else:
        # ZeRO keeps reducing gradients, through the engine's communicator ('onebit', which the
        # optimizer's record chose), 1-bit after the freeze.
        assert a["exchange"] == "gradients" and all(a["reduction"])
        assert stats["reduce_scatter"]["calls"] == 3 and stats["reduce_scatter_1bit"]["calls"] == 3
    exact = stats["all_reduce" if stage == 0 else "reduce_scatter"]
    compressed = stats["all_to_all" if stage == 0 else "reduce_scatter_1bit"]
    assert compressed["bytes"] * 10 < exact["bytes"]  # same number of calls, 1/16 of the bytes


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_checkpoint_mid_compression_resumes_identically(two_ranks, stage):
    for r in range(2):
        res = two_ranks[r][f"engine_ckpt_{stage}"]
        assert res["frozen"]
        assert torch.equal(res["straight"], res["resumed"])


def test_onebit_communicator_under_adam_through_the_engine(two_ranks):
    a, b = (r["engine_onebit_communicator"] for r in two_ranks)
    assert a["type"] == "OneBitCommunicator"
    assert torch.equal(a["params"], b["params"])
    # Every step's gradient units go 1-bit, each under its unit's name from the first backward on.
    assert a["stats"]["all_reduce_1bit"]["calls"] == 4 * len(a["keys"])
    assert all(k.startswith("grad/") for k in a["keys"])


def test_masked_all_reduce_matches_reference_and_dead_elements_come_out_zero(two_ranks):
    results = [r["masked_all_reduce_steps"] for r in two_ranks]
    layout = ChunkLayout.for_all_reduce(MASKED_NUMEL, 2)
    worker = [torch.zeros(2, layout.chunk) for _ in range(2)]
    server = [torch.zeros(1, layout.chunk) for _ in range(2)]
    inputs = [onebit_ranks.rank_inputs(r, STEPS, MASKED_NUMEL, seed=2) for r in range(2)]
    live = onebit_ranks.dead_elements(MASKED_NUMEL)
    for step in range(STEPS):
        expected = simulate_all_reduce([inputs[r][step] for r in range(2)], worker, server, live)
        for r in range(2):
            out = results[r]["outs"][step]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            assert torch.all(out[~live] == 0) and torch.all(out[live] != 0)
    for r in range(2):
        torch.testing.assert_close(results[r]["worker"], worker[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(results[r]["server"], server[r], rtol=1e-5, atol=1e-5)


def test_onebit_adam_matches_float64_reference_of_the_algorithm(two_ranks):
    """Stage-0 1-bit Adam on two ranks against a float64 one-process simulation: warm-up AdamW,
    then local momenta, compressed average of ``m / d`` with both error buffers, frozen variance
    and its bias correction; elements without gradient in warm-up stay put."""
    a, b = (r["onebit_adam_synthetic"] for r in two_ranks)
    grads = [[torch.cat([g.reshape(-1) for g in onebit_ranks.synthetic_grads(r, t, SYN_FREEZE)]) for r in range(2)]
             for t in range(SYN_STEPS)]
    expected = simulate_onebit_adam(a["x0"], grads, SYN_STEPS, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                    weight_decay=0.01, freeze_step=SYN_FREEZE)
    for step in range(SYN_STEPS):
        assert torch.equal(a["params"][step], b["params"][step]), f"replicas differ at step {step}"
        torch.testing.assert_close(a["params"][step].double(), expected[step], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}: {m}")
    cold = onebit_ranks.COLD
    # Cold elements got gradients after the freeze, but had v = 0: only weight decay moved them.
    decay = (1 - 1e-2 * 0.01) ** SYN_STEPS
    torch.testing.assert_close(a["params"][-1][:cold], a["x0"][:cold] * decay)


def test_zero_one_adam_matches_float64_reference_of_the_algorithm(two_ranks):
    """0/1 Adam on two ranks against a float64 simulation: variance steps on a doubling interval
    with 1-bit gradient steps between them, then local steps synchronised on a doubling interval."""
    a, b = (r["zero_one_adam_synthetic"] for r in two_ranks)
    zo = onebit_ranks.ZERO_ONE
    grads = [[torch.cat([g.reshape(-1) for g in onebit_ranks.synthetic_grads(r, t, onebit_ranks.ZERO_ONE_COLD_STEPS)])
              for r in range(2)] for t in range(ZO_STEPS)]
    expected = simulate_zero_one_adam(a["x0"], grads, ZO_STEPS, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                      weight_decay=0.01, **zo)
    # Variance steps: 1, 2 (interval 1), 4, 6 (interval 2), 8 (interval 4); then local steps.
    assert [t + 1 for t, r in enumerate(a["reduced"]) if r] == [1, 2, 4, 6, 8]
    # Local steps synchronise at 11, 12, 13 (interval 1), 14, 16 (2), 20, 24 (4, the clipper).
    synced = [11, 12, 13, 14, 16, 20, 24]
    for step in range(ZO_STEPS):
        t = step + 1
        if t <= zo["var_freeze_step"] or t in synced:
            assert torch.equal(a["params"][step], b["params"][step]), f"replicas differ after step {t}"
        torch.testing.assert_close(a["params"][step].double(), expected[step], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {t}: {m}")
    assert not torch.equal(a["params"][16], b["params"][16]), "step 17 is local: replicas differ"
    stats = a["stats"]
    assert stats["all_reduce"]["calls"] == 5 * 2  # the variance steps' two gradients
    assert stats["all_to_all"]["calls"] == 5 + len(synced)  # 1-bit gradient steps and synchronisations


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_trains_with_zero_one_adam(two_ranks, precision):
    """var_freeze_step 4, var_update_scaler 1, local_step_scaler 2: variance steps 1, 2, 4 (the
    partitioner reduces gradients before them only), a 1-bit gradient step at 3, then local steps
    synchronised at 5, 6 and 8."""
    a, b = (r[f"engine_zo_{precision}"] for r in two_ranks)
    assert a["frozen"] and all(torch.isfinite(torch.tensor(a["losses"])))
    assert torch.equal(a["params"], b["params"]), "replicas differ after a synchronisation"
    # gradient_reduction after each step, i.e. for the next one.
    assert a["reduction"] == [True, False, True, False, False, False, False, False]
    stats = a["stats"]
    # 3 gradient all-reduces, each with the engine's 4-byte non-finite-loss flag beside it; local
    # steps communicate nothing
    assert stats["all_reduce"]["calls"] == 3 + 3 and stats["all_to_all"]["calls"] == 4


@pytest.mark.parametrize("scenario,frozen", [("engine_ckpt_zo", True), ("engine_ckpt_zo_var", False)])
def test_engine_zero_one_adam_checkpoint_resumes_identically(two_ranks, scenario, frozen):
    """Saved during local steps, or between a 1-bit gradient step and a variance step."""
    for r in range(2):
        res = two_ranks[r][scenario]
        assert res["frozen"] is frozen
        assert torch.equal(res["straight"], res["resumed"])
