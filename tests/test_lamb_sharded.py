"""LAMB on ZeRO shards equals LAMB on whole parameters: per-parameter norms are assembled from
per-piece partial sums with one all-reduce per step (``Lamb.set_shard_norms``)."""
from __future__ import annotations

import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.optim.lamb import Lamb
from zkit.testing import run_ranks

import lamb_ranks as lr


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# -- ranks simulated by threads: the protocol itself, for arbitrary piece layouts ------------------
class ThreadRanks:
    """An in-process sum all-reduce between threads; every thread adds in the same order."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=20)
        self.inbox: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> None:
            self.calls[rank] += 1
            self.inbox[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.inbox).sum(0)
            self.barrier.wait()
            t.copy_(total)

        return reduce


@st.composite
def layouts(draw):
    """Parameter shapes, a rank count and an assignment of contiguous pieces to ranks. A rank may
    get several pieces of one parameter, or none of any."""
    shapes = draw(st.lists(st.sampled_from([(1,), (5,), (3, 4), (2, 3, 2), (7,)]), min_size=1, max_size=4))
    world = draw(st.integers(1, 4))
    pieces = []  # (param, start, end, rank)
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3))) - {n})
        bounds = [0, *cuts, n]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append((i, a, b, draw(st.integers(0, world - 1))))
    groups = draw(st.lists(st.integers(0, 1), min_size=len(shapes), max_size=len(shapes)))
    return shapes, world, pieces, groups


def _whole_and_grads(shapes, steps, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(steps)]
    return params, grads


HP = dict(lr=0.05, weight_decay=0.02, max_coeff=3.0, min_coeff=0.1)
GROUP_OPTIONS = ({}, {"max_grad_norm": 1.5, "weight_decay": 0.0})


def _reference(shapes, groups, steps, seed):
    params, grads = _whole_and_grads(shapes, steps, seed)
    params = [torch.nn.Parameter(p) for p in params]
    opt = Lamb([{"params": [p for p, gi in zip(params, groups) if gi == k], **GROUP_OPTIONS[k]} for k in (0, 1)], **HP)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _sharded(shapes, world, pieces, groups, steps, seed):
    """Every rank a thread with its own Lamb over its pieces; returns the reassembled parameters
    and the all-reduce count per rank."""
    whole, grads = _whole_and_grads(shapes, steps, seed)
    flat = [w.reshape(-1) for w in whole]
    ranks = ThreadRanks(world)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            mine = [(i, a, b) for i, a, b, r in pieces if r == rank]
            opt_params = {k: [] for k in (0, 1)}
            index = {k: [] for k in (0, 1)}
            held = []
            for i, a, b in mine:
                p = torch.nn.Parameter(flat[i][a:b].clone())
                opt_params[groups[i]].append(p)
                index[groups[i]].append(i)
                held.append((p, i, a, b))
            if not held:  # as the partitioner does: an empty placeholder, never given a gradient
                opt_params[0].append(torch.nn.Parameter(torch.zeros(0, dtype=torch.float64)))
                index[0].append(0)
            opt = Lamb([{"params": opt_params[k], **GROUP_OPTIONS[k]} for k in (0, 1)], **HP)
            opt.set_shard_norms(index[0] + index[1], len(shapes), ranks.all_reduce(rank))
            for step_grads in grads:
                for p, i, a, b in held:
                    p.grad = step_grads[i].reshape(-1)[a:b].clone()
                opt.step()
            for p, i, a, b in held:
                flat[i][a:b] = p.detach()  # disjoint ranges: threads never write the same element
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            ranks.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return whole, ranks.calls


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_pieces_on_any_layout_step_exactly_like_whole_parameters(layout, seed):
    shapes, world, pieces, groups = layout
    steps = 3
    got, calls = _sharded(shapes, world, pieces, groups, steps, seed)
    want = _reference(shapes, groups, steps, seed)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # Group 1 clips (even when empty), so each step reduces the clip norms, then the trust-ratio
    # norms: on every rank, including one that holds nothing.
    assert calls == [2 * steps] * world


def test_one_all_reduce_per_step_without_clipping():
    ranks = ThreadRanks(1)
    p = torch.nn.Parameter(torch.randn(6))
    opt = Lamb([p], lr=0.1)
    opt.set_shard_norms([0], 1, ranks.all_reduce(0))
    for _ in range(3):
        p.grad = torch.randn(6)
        opt.step()
    assert ranks.calls == [3]
    assert len(opt.get_lamb_coeffs()) == 1


@pytest.mark.parametrize(
    "args, error, message",
    [
        (([0, 1], 2, None), TypeError, "optimizer 'lamb': set_shard_norms needs a callable all_reduce, got None"),
        (([0, 1], 0, print), ValueError, "optimizer 'lamb': set_shard_norms needs num_params >= 1, got 0"),
        (([0, 2], 2, print), ValueError, "optimizer 'lamb': set_shard_norms: parameter index 2 is outside 0..1"),
        (([0, 0.5], 2, print), TypeError, "optimizer 'lamb': set_shard_norms: parameter index 0.5 is not an integer"),
        (([0], 2, print), ValueError,
         "optimizer 'lamb': set_shard_norms got 1 parameter indices for the 2 parameters in param_groups"),
    ],
)
def test_set_shard_norms_rejects_bad_mappings(args, error, message):
    opt = Lamb([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(error, match=re.escape(message)):
        opt.set_shard_norms(*args)


def test_param_groups_changed_after_mapping_is_an_error():
    opt = Lamb([torch.nn.Parameter(torch.ones(2))])
    opt.set_shard_norms([0], 1, lambda t: None)
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=re.escape(
            "optimizer 'lamb': param_groups now hold 2 parameters but set_shard_norms mapped 1; "
            "call set_shard_norms again after changing param_groups")):
        opt.step()


# -- the ZeRO engine on real gloo ranks --------------------------------------------------------------
TWO_RANK_CASES = [
    (1, "fp32", 1, False), (2, "fp32", 1, False), (3, "fp32", 1, False),
    (1, "fp32", 2, True), (2, "fp32", 1, True), (3, "fp32", 2, True),
    *[(s, d, 1, False) for s in (0, 1, 2, 3) for d in ("bf16", "fp16")],
]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(lr.two_rank_suite, 2, args=(TWO_RANK_CASES,), timeout=300)


@pytest.mark.parametrize("case", [c for c in TWO_RANK_CASES if c[1] == "fp32"], ids=str)
def test_two_ranks_fp32_match_single_process_lamb(two_ranks, case):
    stage, _, gas, split = case
    want = lr.reference(3, gas, 2, split)
    results = [r["matrix"][case] for r in two_ranks]
    for params, _, owned in results:
        assert owned > 0
        assert _max_diff(params, want) < 1e-5
    assert _max_diff(results[0][0], results[1][0]) == 0  # every rank ends with the same parameters


@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.parametrize("dtype", ("bf16", "fp16"))
def test_two_ranks_low_precision_close_to_stage0(two_ranks, stage, dtype):
    base = two_ranks[0]["matrix"][(0, dtype, 1, False)][0]
    got = two_ranks[0]["matrix"][(stage, dtype, 1, False)][0]
    assert _max_diff(got, base) < (2e-2 if dtype == "bf16" else 2e-3)


def test_trust_ratio_costs_one_small_all_reduce_per_step(two_ranks):
    comm = two_ranks[0]["comm"]
    lamb, adamw = comm["lamb"]["all_reduce"], comm.get("adamw", {}).get("all_reduce", {"calls": 0, "bytes": 0})
    steps, params = 3, 5  # TiedNet: embed.weight, mix.weight, mix.bias, norm.weight, norm.bias
    assert lamb["calls"] - adamw["calls"] == steps
    assert lamb["bytes"] - adamw["bytes"] == steps * 2 * params * 8  # [2, params] fp64, ring over 2 ranks


def test_four_ranks_including_one_that_owns_nothing():
    cases = [(1, "fp32", 1, True), (2, "fp32", 1, False), (3, "fp32", 1, False)]
    results = run_ranks(lr.four_rank_suite, 4, args=(cases,), timeout=300)
    for case in cases:
        want = lr.reference(3, case[2], 4, case[3])
        for r in results:
            assert _max_diff(r["matrix"][case][0], want) < 1e-5
    want = lr.tiny_reference(4)
    for stage in (1, 2, 3):
        assert [r["tiny"][stage]["owned"] for r in results][3] == 0  # rank 3 holds no piece at all
        for r in results:
            assert _max_diff(r["tiny"][stage]["params"], want) < 1e-6


@pytest.mark.parametrize("stage", (1, 3))
def test_non_elementwise_optimizer_without_shard_norms_is_refused(two_ranks, stage):
    for r in two_ranks:
        assert r["refused"][stage] == (
            f"optimizer 'layerwise_sgd' is not elementwise (it needs whole-parameter norms), so it cannot "
            f"step on ZeRO stage {stage} shards; use stage 0 or an elementwise optimizer"
        )
