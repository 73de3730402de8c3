"""Bit packing of signs: 8 signs per byte, most significant bit first (numpy's ``packbits`` order).

Everything here is a batched tensor op, so it runs at memory speed on CPU and on CUDA alike.
A sign bit is 1 for a non-negative float and 0 for a negative one, read from the float's sign bit:
1-bit compression has no zero, ``+0.0`` counts as positive (as in DeepSpeed's compressed
all-reduce) and ``-0.0`` as negative.
"""
from __future__ import annotations

import torch

#: Bit weights of one byte, most significant first.
_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)
_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)
_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _constant(name: str, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    t = _cache.get((name, device))
    if t is None:
        t = _cache[(name, device)] = torch.tensor(values, dtype=torch.uint8, device=device)
    return t


def _weights(device: torch.device) -> torch.Tensor:
    return _constant("weights", _WEIGHTS, device)


def packed_nbytes(numel: int) -> int:
    """Bytes that ``numel`` signs take once packed (the last byte padded with zero bits)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return (numel + 7) // 8


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool (or 0/1 uint8) tensor of any shape, read flat, into ``uint8`` bytes.

    A length that is not a multiple of 8 is padded with zero bits; :func:`unpack_bits` with the
    original length undoes it exactly.
    """
    flat = bits.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.dtype != torch.uint8:
        raise TypeError(f"pack_bits takes a bool or uint8 tensor of 0/1 values, got {flat.dtype}")
    tail = (-flat.numel()) % 8
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    return flat.view(-1, 8).mul(_weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits_u8(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``uint8`` bytes ``packed``, as a flat ``uint8`` tensor of 0/1."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits takes a uint8 tensor, got {packed.dtype}")
    if numel > packed.numel() * 8:
        raise ValueError(f"{packed.numel()} bytes hold at most {packed.numel() * 8} bits, asked for {numel}")
    # Shift each byte right by 7..0 and keep the low bit: one pass, no comparison.
    bits = packed.reshape(-1, 1).bitwise_right_shift(_constant("shifts", _SHIFTS, packed.device)).bitwise_and_(1)
    return bits.view(-1)[:numel]


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``uint8`` bytes ``packed``, as a flat bool tensor."""
    return unpack_bits_u8(packed, numel).view(torch.bool)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``x`` (bit 1 for non-negative) 8 per byte."""
    # Pack the sign bits and invert the 8x fewer bytes; the zero bits padding a partial last
    # byte become ones, which unpacking never reads.
    return pack_bits(torch.signbit(x.reshape(-1))).bitwise_not_()


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``+1``/``-1`` values of ``dtype`` for the first ``numel`` packed signs."""
    bits = unpack_bits_u8(packed, numel)
    # 2b - 1 maps {0, 1} to {-1, +1} without a branch.
    return bits.to(dtype).mul_(2).sub_(1)
