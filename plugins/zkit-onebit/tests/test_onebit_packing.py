"""Bit packing and the chunk layout: exact round trips for any length."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_onebit.compression import ChunkLayout, LiveMask, compress_rows, decode_packets
from zkit_onebit.packing import pack_bits, pack_signs, packed_nbytes, unpack_bits, unpack_signs

lengths = st.integers(min_value=1, max_value=2000)


@settings(max_examples=60, deadline=None)
@given(n=lengths, seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_bits_roundtrip_any_length(n, seed):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n) == (n + 7) // 8
    assert torch.equal(unpack_bits(packed, n), bits)
    # Same byte order as numpy's packbits (most significant bit first).
    assert np.array_equal(packed.numpy(), np.packbits(bits.numpy()))


@settings(max_examples=60, deadline=None)
@given(n=lengths, seed=st.integers(0, 2**31 - 1))
def test_signs_roundtrip_signed_zeros(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::5] = 0.0
    x[::7] = -0.0
    signs = unpack_signs(pack_signs(x), n)
    assert torch.equal(signs, torch.copysign(torch.ones(n), x))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), w=st.integers(1, 9), kind=st.sampled_from(["flat", "sharded"]))
def test_layout_roundtrip(n, w, kind):
    if kind == "sharded":
        n = n * w
        layout = ChunkLayout.for_reduce_scatter(n, w)
    else:
        layout = ChunkLayout.for_all_reduce(n, w)
    assert layout.chunk % 8 == 0 and sum(layout.counts) == n
    assert layout.chunk * w >= n
    x = torch.randn(n)
    m = layout.to_matrix(x)
    assert m.shape == (w, layout.chunk)
    padding = m.clone()
    layout.zero_padding(padding)
    assert torch.equal(padding, m), "to_matrix leaves zeros in the padding"
    out = torch.empty(n, dtype=torch.float64)
    layout.from_matrix(m, out)
    assert torch.equal(out.float(), x)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 500), w=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_compressed_rows_keep_norm_and_decode(n, w, seed):
    layout = ChunkLayout.for_all_reduce(n, w)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    m = layout.to_matrix(x)
    orig = m.clone()
    err = torch.zeros_like(m)
    packets = compress_rows(m, err, layout, range(w))
    assert torch.equal(m, orig), "compress_rows leaves its input alone"
    assert packets.shape == (w, layout.packet_bytes)
    decoded = decode_packets(packets, layout.chunk)
    layout.zero_padding(decoded)
    # decoded + error reconstructs the input exactly up to rounding, and norms are kept per row.
    torch.testing.assert_close(decoded + err, orig, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.linalg.vector_norm(decoded, dim=1), torch.linalg.vector_norm(orig, dim=1), rtol=1e-5, atol=1e-6
    )


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 700), w=st.integers(1, 4), steps=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_error_feedback_running_sum_tracks_inputs(n, w, steps, seed):
    """sum of compressed values = sum of inputs - the current error, and the error stays bounded."""
    g = torch.Generator().manual_seed(seed)
    layout = ChunkLayout.for_all_reduce(n, w)
    err = torch.zeros(w, layout.chunk)
    sum_in = torch.zeros(w, layout.chunk)
    sum_out = torch.zeros(w, layout.chunk)
    for _ in range(steps):
        x = layout.to_matrix(torch.randn(n, generator=g))
        sum_in += x
        decoded = decode_packets(compress_rows(x, err, layout, range(w)), layout.chunk)
        layout.zero_padding(decoded)
        sum_out += decoded
    torch.testing.assert_close(sum_out + err, sum_in, rtol=1e-4, atol=1e-3)
    # Without feedback the gap would grow like sqrt(steps); with it, it stays the size of one step.
    per_element = torch.linalg.vector_norm(err) / n**0.5
    assert per_element < 4.0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 500), w=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_masked_rows_keep_the_norm_of_their_live_elements(n, w, seed):
    """Dead elements are sent as zero and keep no error; a row's scale is the RMS of its live
    elements, so the live part of the decoded row has the live part's norm."""
    g = torch.Generator().manual_seed(seed)
    layout = ChunkLayout.for_all_reduce(n, w)
    live = torch.rand(n, generator=g) < 0.6
    mask = LiveMask.from_flat(layout, live)
    x = layout.to_matrix(torch.randn(n, generator=g))
    err = torch.zeros_like(x)
    decoded = decode_packets(compress_rows(x, err, layout, range(w), mask), layout.chunk) * mask.matrix
    kept = x * mask.matrix
    assert torch.all(err[~mask.matrix] == 0)
    torch.testing.assert_close(decoded + err, kept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.linalg.vector_norm(decoded, dim=1), torch.linalg.vector_norm(kept, dim=1), rtol=1e-5, atol=1e-6
    )


def test_bad_inputs_have_clear_errors():
    with pytest.raises(TypeError, match="bool or uint8"):
        pack_bits(torch.zeros(8))
    with pytest.raises(TypeError, match="takes a uint8 tensor"):
        unpack_bits(torch.zeros(2), 8)
    with pytest.raises(ValueError, match="hold at most 16 bits"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="cannot compress an empty tensor"):
        ChunkLayout.for_all_reduce(0, 2)
    with pytest.raises(ValueError, match="does not split into 3 shards"):
        ChunkLayout.for_reduce_scatter(10, 3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ChunkLayout.for_all_reduce(10, 0)
    layout = ChunkLayout.for_all_reduce(10, 2)
    with pytest.raises(ValueError, match="a live mask must be a bool tensor of 10 elements, got torch.float32 with 10"):
        LiveMask.from_flat(layout, torch.ones(10))
    with pytest.raises(ValueError, match="a live mask must be a bool tensor of 10 elements, got torch.bool with 9"):
        LiveMask.from_flat(layout, torch.ones(9, dtype=torch.bool))
