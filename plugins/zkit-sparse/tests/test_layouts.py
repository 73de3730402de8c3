"""Layouts: hand-checked small cases (DeepSpeed's definitions) and properties."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_sparse import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
)


def _t(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_dense_is_all_ones():
    layout = DenseSparsityConfig(num_heads=3, block=16).make_layout(64)
    assert layout.shape == (3, 4, 4) and bool((layout == 1).all())


def test_fixed_bidirectional_exact():
    layout = FixedSparsityConfig(1, block=16, num_local_blocks=2, num_global_blocks=1).make_layout(64)
    assert torch.equal(layout[0], _t([[1, 1, 0, 1], [1, 1, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]]))


def test_fixed_unidirectional_exact():
    cfg = FixedSparsityConfig(1, block=16, num_local_blocks=2, attention="unidirectional")
    assert torch.equal(cfg.make_layout(64)[0],
                       _t([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]))


def test_fixed_short_last_window_gets_global_block():
    layout = FixedSparsityConfig(1, block=16, num_local_blocks=2).make_layout(80)
    assert torch.equal(layout[0], _t([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1], [0, 1, 1, 1, 1],
                                      [0, 1, 1, 1, 1], [0, 1, 0, 1, 1]]))


def test_fixed_different_global_patterns_per_head():
    cfg = FixedSparsityConfig(2, block=16, num_local_blocks=2, different_layout_per_head=True,
                              num_different_global_patterns=2)
    layout = cfg.make_layout(64)
    assert layout[0, :, 1].all() and layout[0, :, 3].all()  # last block of each window
    assert layout[1, :, 0].all() and layout[1, :, 2].all()  # first block of each window
    assert not torch.equal(layout[0], layout[1])


def test_bslongformer_exact():
    layout = BSLongformerSparsityConfig(1, block=16, num_sliding_window_blocks=3).make_layout(80)
    expected = _t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1],
                   [1, 0, 0, 1, 1]])
    assert torch.equal(layout[0], expected)
    bigbird = BigBirdSparsityConfig(1, block=16, num_random_blocks=0).make_layout(80)
    assert torch.equal(bigbird[0], expected)


def test_variable_exact():
    cfg = VariableSparsityConfig(1, block=16, local_window_blocks=[1, 2], global_block_indices=[0])
    assert torch.equal(cfg.make_layout(80)[0],
                       _t([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 1],
                           [1, 0, 0, 1, 1]]))


def test_variable_global_ranges_and_horizontal():
    cfg = VariableSparsityConfig(1, block=16, local_window_blocks=[1], global_block_indices=[1],
                                 global_block_end_indices=[3], horizontal_global_attention=True)
    layout = cfg.make_layout(80)[0]
    assert layout[:, 1:3].all() and layout[1:3, :].all()
    assert layout[0, 0] == 1 and layout[0, 3] == 0


def test_random_blocks_follow_deepspeed_draw_order():
    # DeepSpeed draws random.sample(range(nb), k) row by row from the global generator.
    cfg = BigBirdSparsityConfig(1, block=16, num_random_blocks=2, num_sliding_window_blocks=1,
                                num_global_blocks=1, seed=7)
    layout = cfg.make_layout(16 * 8)[0]
    rng = random.Random(7)
    for row in range(8):
        for col in rng.sample(range(8), 2):
            assert layout[row, col] == 1
    random.seed(7)
    unseeded = BigBirdSparsityConfig(1, block=16, num_random_blocks=2, num_sliding_window_blocks=1,
                                     seed=None).make_layout(16 * 8)
    assert torch.equal(unseeded[0], layout)


def test_random_layout_is_reproducible_and_per_head():
    kw = dict(block=16, num_random_blocks=2, different_layout_per_head=True)
    a = VariableSparsityConfig(4, **kw).make_layout(256)
    b = VariableSparsityConfig(4, **kw).make_layout(256)
    assert torch.equal(a, b)
    assert any(not torch.equal(a[0], a[h]) for h in range(1, 4))


def _is_symmetric(layout):
    return torch.equal(layout, layout.transpose(1, 2))


def _is_causal(layout):
    return torch.equal(layout, torch.tril(layout))


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(3, 24), window=st.sampled_from([1, 3, 5]), global_blocks=st.integers(1, 3),
       uni=st.booleans())
def test_bigbird_and_longformer_properties(nb, window, global_blocks, uni):
    attention = "unidirectional" if uni else "bidirectional"
    window = min(window, nb)
    bb = BigBirdSparsityConfig(2, block=16, num_random_blocks=0, num_sliding_window_blocks=window,
                               num_global_blocks=min(global_blocks, nb), attention=attention)
    lf = BSLongformerSparsityConfig(2, block=16, num_sliding_window_blocks=window,
                                    global_block_indices=list(range(min(global_blocks, nb))),
                                    attention=attention)
    for layout in (bb.make_layout(16 * nb), lf.make_layout(16 * nb)):
        assert torch.equal(layout[0], layout[1])
        assert (_is_causal if uni else _is_symmetric)(layout)
        g = min(global_blocks, nb)
        assert layout[:, :, :g].sum() == (2 * g * (nb + nb - g + 1) // 2 if uni else 2 * nb * g)
        if not uni:
            assert layout[:, :g, :].all()  # global rows
        counts = layout[0].sum(1)
        half = window // 2
        for row in range(nb):  # the window is always present around the diagonal
            lo, hi = max(0, row - half), (row + 1 if uni else min(nb, row + half + 1))
            assert layout[0, row, lo:hi].all()
            assert counts[row] >= hi - lo


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(1, 24), local=st.sampled_from([1, 2, 4, 6]), uni=st.booleans(),
       horizontal=st.booleans())
def test_fixed_properties(nb, local, uni, horizontal):
    attention = "unidirectional" if uni else "bidirectional"
    cfg = FixedSparsityConfig(1, block=16, num_local_blocks=local, attention=attention,
                              horizontal_global_attention=horizontal and not uni)
    layout = cfg.make_layout(16 * nb)
    assert bool(layout[0].diagonal().all())
    if uni:
        assert _is_causal(layout)
    elif horizontal:
        assert _is_symmetric(layout)
    # every full window contributes its last block as a global column
    for start in range(local - 1, nb - nb % local, local):
        first = start if uni else 0
        assert layout[0, first:, start].all()


def test_local_sliding_window():
    layout = LocalSlidingWindowSparsityConfig(1, block=16, num_sliding_window_blocks=3).make_layout(64)
    assert torch.equal(layout[0], _t([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]))


@pytest.mark.parametrize("cfg, message", [
    (lambda: FixedSparsityConfig(1, block=16).make_layout(72), "not divisible by the block size 16"),
    (lambda: FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=3), "divisible by num_global_blocks"),
    (lambda: FixedSparsityConfig(1, attention="causal"), "'unidirectional' or 'bidirectional'"),
    (lambda: FixedSparsityConfig(1, attention="unidirectional", horizontal_global_attention=True),
     "horizontal_global_attention needs attention='bidirectional'"),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2), "needs different_layout_per_head=True"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5),
     "cannot exceed num_local_blocks // num_global_blocks = 4"),
    (lambda: VariableSparsityConfig(1, global_block_indices=[0, 4], global_block_end_indices=[2]),
     "global_block_indices has 2 entries but global_block_end_indices has 1"),
    (lambda: BSLongformerSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3]),
     "start index 3 must be smaller than its end index 3"),
    (lambda: BigBirdSparsityConfig(1, block=16, num_random_blocks=5).make_layout(64),
     "num_random_blocks (5) must not exceed the number of blocks in a row (4)"),
    (lambda: BSLongformerSparsityConfig(1, block=16, num_sliding_window_blocks=7).make_layout(64),
     "num_sliding_window_blocks (7) must not exceed"),
    (lambda: DenseSparsityConfig(0), "num_heads must be a positive integer"),
    (lambda: VariableSparsityConfig(1, local_window_blocks=[]), "at least one window size"),
])
def test_bad_parameters_have_clear_errors(cfg, message):
    with pytest.raises((ValueError, NotImplementedError)) as info:
        cfg()
    assert message in str(info.value)
