"""fp16 with accumulated micro-batches and a tied embedding computes exactly the math written out by
hand (fp16 gradients summed over micro-batches and averaged over replicas, unscaled into the fp32
master's AdamW step): no gradient of the tied weight scaled, unscaled or summed twice, no step
skipped. The accumulated and the whole-batch runs still differ by one Adam step in one element,
whose gradient is within fp16's rounding of zero (composition_fuzz_model.rounding_decided)."""
from __future__ import annotations

import torch

from zkit.testing import run_ranks

from fp16_accumulation_ranks import runs

CASES = [(0, 1), (0, 2)]  # (ZeRO stage, micro-batches per step)


def test_fp16_accumulated_tied_run_is_the_hand_written_math():
    got = run_ranks(runs, 2, args=(CASES,), timeout=300)[0]
    by_hand = got["by_hand"]
    for stage, accumulation in CASES:
        run = got[(stage, accumulation)]
        assert run["skipped"] == 0 and run["scale"] == 256.0, run
        for name, p in run["params"].items():
            assert torch.equal(p, by_hand[accumulation][name]), (stage, accumulation, name)
    # the whole batch and the accumulated one: a single element a step (lr 1e-2) apart
    apart = {n: (by_hand[1][n] - by_hand[2][n]).abs() for n in by_hand[1]}
    moved = [(n, d.max().item()) for n, d in apart.items() if d.max() > 2e-3 * by_hand[1][n].abs().max()]
    assert [n for n, _ in moved] == ["layers.1.ln_2.weight"] and 0.005 < moved[0][1] < 0.0102, moved
    assert (apart["layers.1.ln_2.weight"] > 1e-3).sum() == 1
