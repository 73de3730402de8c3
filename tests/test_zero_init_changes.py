"""A model built under ``zkit.zero.Init`` and changed before ``initialize`` (a parameter removed,
some parameters frozen), or handed to a stage below 3, trains exactly like the same model built
whole (fp32, parameters after 3 steps)."""
import pytest

from zkit.testing import run_ranks

import zero_init_changes_ranks as zr

# Per-module units (stage3_gather_unit "module") of the test GPT still those Init made, out of all:
# per block, the fused QKV's unit is made again (its bias removed or frozen, its weight replaced);
# with only biases trainable every unit is; a frozen module has no unit (the tied LM head's lies in
# the embedding's). Per block, stage 3 makes every unit of the gathered values of Init's: 2 blocks
# and the root.
KEPT = {"bias_none": (13, 15), "weight_replaced": (13, 15), "bias_frozen": (13, 15), "bitfit": (0, 13),
        "module_frozen": (13, 13)}
STAGE3 = [(change, 3, unit) for change in KEPT for unit in ("module", "block")]
BELOW_3 = [("none", 0, "block"), ("none", 1, "block"), ("none", 2, "block"), ("bias_frozen", 2, "block")]


@pytest.fixture(scope="module", params=(1, 2), ids=lambda w: f"world{w}")
def results(request) -> dict:
    """Every case on ``world`` ranks, in one job (starting the ranks costs more than a case)."""
    return run_ranks(zr.init_against_whole, request.param, args=(STAGE3 + BELOW_3,), timeout=600)[0]


def test_changed_after_init_trains_like_built_whole_at_stage3(results):
    for case in STAGE3:
        diff, kept = results[case]
        assert diff is not None and diff < 1e-6, (case, results)
        assert kept == (KEPT[case[0]] if case[2] == "module" else (0, 3)), (case, results)


def test_built_under_init_trains_at_stages_below_3(results):
    for case in BELOW_3:
        diff, _ = results[case]
        assert diff is not None and diff < 1e-6, (case, results)
