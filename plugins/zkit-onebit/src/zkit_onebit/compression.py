"""Error-compensated 1-bit compression of a tensor split into one chunk per rank.

A tensor of ``numel`` elements is laid out as a ``[world_size, chunk]`` matrix (``chunk`` a
multiple of 8, so every chunk packs into whole bytes); row ``r`` is the chunk rank ``r`` serves.
Each row is compressed to its signs (1 bit each) and one fp32 scale ``||row||_2 / sqrt(count)``
over the row's ``count`` real elements, so the compressed row keeps the row's L2 norm. What the
compression loses is kept in an error buffer and added back before the next compression (error
feedback), which makes the running sum of compressed values track the running sum of inputs.

On the wire a row is one *packet*: ``chunk / 8`` bytes of packed signs followed by the 4 bytes of
its fp32 scale, so signs and scales travel in one collective instead of two.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from zkit_onebit.packing import pack_bits, unpack_bits_u8

SCALE_BYTES = 4


@attrs.frozen
class ChunkLayout:
    """How ``numel`` real elements map onto a ``[world_size, chunk]`` matrix.

    ``kind="flat"`` (all-reduce): the tensor fills the matrix row by row, padding at the end.
    ``kind="sharded"`` (reduce-scatter): the tensor is ``world_size`` shards of ``numel //
    world_size`` elements, shard ``r`` at the start of row ``r``, each row padded at its end.
    """

    kind: str
    numel: int
    world_size: int
    chunk: int
    counts: tuple[int, ...]

    @classmethod
    def for_all_reduce(cls, numel: int, world_size: int) -> "ChunkLayout":
        _check_sizes(numel, world_size)
        chunk = -(-numel // (8 * world_size)) * 8
        counts = tuple(min(max(numel - r * chunk, 0), chunk) for r in range(world_size))
        return cls("flat", numel, world_size, chunk, counts)

    @classmethod
    def for_reduce_scatter(cls, numel: int, world_size: int) -> "ChunkLayout":
        _check_sizes(numel, world_size)
        if numel % world_size:
            raise ValueError(f"reduce_scatter input of {numel} elements does not split into {world_size} shards")
        shard = numel // world_size
        return cls("sharded", numel, world_size, -(-shard // 8) * 8, (shard,) * world_size)

    @property
    def packet_bytes(self) -> int:
        """Bytes of one row on the wire: packed signs plus the scale."""
        return self.chunk // 8 + SCALE_BYTES

    def to_matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new fp32 ``[world_size, chunk]`` matrix holding ``tensor``, zeros in the padding."""
        w, c = self.world_size, self.chunk
        flat = tensor.reshape(-1)
        if self.kind == "flat":
            buf = flat.new_zeros(w * c, dtype=torch.float32)
            buf[: self.numel].copy_(flat)
            return buf.view(w, c)
        buf = flat.new_zeros((w, c), dtype=torch.float32)
        buf[:, : self.counts[0]].copy_(flat.view(w, -1))
        return buf

    def add_into(self, matrix: torch.Tensor, tensor: torch.Tensor) -> None:
        """``matrix += tensor`` laid out (the padding of ``matrix`` is left as it is)."""
        if self.kind == "flat":
            matrix.view(-1)[: self.numel].add_(tensor.reshape(-1))
        else:
            matrix[:, : self.counts[0]].add_(tensor.reshape(self.world_size, -1))

    def from_matrix(self, matrix: torch.Tensor, out: torch.Tensor) -> None:
        """Write the real elements of ``matrix`` into ``out`` (any dtype, ``numel`` elements)."""
        if self.kind == "flat":
            out.view(-1).copy_(matrix.reshape(-1)[: self.numel])
        else:
            out.view(self.world_size, -1).copy_(matrix[:, : self.counts[0]])

    def zero_padding(self, matrix: torch.Tensor, rows: range | None = None) -> None:
        """Zero the padding of ``matrix`` (whole layout), or of one row given as ``rows``."""
        rows = range(self.world_size) if rows is None else rows
        for i, r in enumerate(rows):
            if self.counts[r] < self.chunk:
                matrix[i, self.counts[r] :].zero_()

    def counts_tensor(self, rows: range, device: torch.device) -> torch.Tensor:
        return torch.tensor([max(self.counts[r], 1) for r in rows], dtype=torch.float32, device=device)


def _check_sizes(numel: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 1:
        raise ValueError(f"cannot compress an empty tensor (numel={numel})")


@attrs.frozen(eq=False)
class LiveMask:
    """Which elements of a layout carry data: ``matrix`` (bool ``[world_size, chunk]``, False in
    the padding) and ``counts`` (fp32 ``[world_size]``, live elements per row, at least 1).

    1-bit compression cannot send an exact zero: an element that is structurally zero (the
    momentum of a parameter element that never had a gradient) would receive ``±scale`` every
    step. Dead elements are sent as zero, decoded as exactly zero, keep no error, and do not count
    in the scale of their row, so a row's scale is the RMS of its live elements."""

    matrix: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def from_flat(cls, layout: ChunkLayout, live: torch.Tensor) -> "LiveMask":
        """From a flat bool tensor of ``layout.numel`` elements (True: carries data)."""
        if live.numel() != layout.numel or live.dtype != torch.bool:
            raise ValueError(f"a live mask must be a bool tensor of {layout.numel} elements, got "
                             f"{live.dtype} with {live.numel()}")
        matrix = layout.to_matrix(live).bool()
        return cls(matrix, matrix.sum(dim=1, dtype=torch.float32).clamp_(min=1))


def compress_rows_(
    matrix: torch.Tensor, layout: ChunkLayout, rows: range, mask: LiveMask | None = None
) -> torch.Tensor:
    """1-bit compress the rows of fp32 ``matrix`` (rows ``rows`` of ``layout``), in place.

    ``matrix`` holds the values to send plus the error carried from the last step; on return it
    holds the new compression error ``x - scale * sign(x)``. Returns the ``uint8`` packets, one row
    per matrix row. The sign is the float's sign bit: ``+0.0`` is positive, ``-0.0`` negative.
    With ``mask``, dead elements are zeroed first and keep no error.
    """
    if mask is not None:
        live = mask.matrix[rows.start : rows.stop]
        matrix.mul_(live)
        counts = mask.counts[rows.start : rows.stop]
    else:
        counts = layout.counts_tensor(rows, matrix.device)
    scales = torch.linalg.vector_norm(matrix, dim=1).div_(counts.sqrt())
    negative = torch.signbit(matrix)
    # Bit 1 = non-negative: pack the sign bits, then invert the (8x fewer) bytes.
    packed = pack_bits(negative).bitwise_not_().view(matrix.shape[0], -1)
    matrix.sub_(torch.copysign(scales[:, None], matrix))
    if mask is not None:
        matrix.mul_(live)
    else:
        layout.zero_padding(matrix, rows)
    return torch.cat([packed, scales.view(-1, 1).view(torch.uint8)], dim=1)


def compress_rows(
    matrix: torch.Tensor, error: torch.Tensor, layout: ChunkLayout, rows: range, mask: LiveMask | None = None
) -> torch.Tensor:
    """Error-compensated compression of ``matrix`` (kept intact) with error buffer ``error``
    (updated in place): adds ``error``, compresses, stores the new error. Returns the packets."""
    error.add_(matrix)
    return compress_rows_(error, layout, rows, mask)


def decode_packets(
    packets: torch.Tensor, chunk: int, factor: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``[rows, chunk]`` values ``factor * scale * sign`` of ``uint8`` packets
    ``[rows, chunk/8 + 4]``, written into ``out`` when given."""
    rows = packets.shape[0]
    nsign = chunk // 8
    # clone: a fresh, aligned buffer to reinterpret as fp32 (a view at an odd offset cannot be).
    scales = packets[:, nsign:].clone(memory_format=torch.contiguous_format).view(torch.float32).view(rows, 1)
    if factor != 1.0:
        scales = scales * factor
    positive = unpack_bits_u8(packets[:, :nsign], rows * chunk).view(rows, chunk)
    if out is None:
        out = torch.empty((rows, chunk), dtype=torch.float32, device=packets.device)
    # (2b - 1) * s as 2bs - s: exact in floating point, and three plain passes.
    return out.copy_(positive).mul_(2 * scales).sub_(scales)


@attrs.define(eq=False)
class ErrorFeedback:
    """The compression errors one rank carries for one tensor between steps.

    ``worker`` (``[world_size, chunk]`` fp32): this rank's error on the whole tensor.
    ``server`` (``[1, chunk]`` fp32, all-reduce only): this rank's error on the chunk it serves.
    """

    layout: ChunkLayout
    worker: torch.Tensor
    server: torch.Tensor | None

    @classmethod
    def zeros(cls, layout: ChunkLayout, device: torch.device, with_server: bool) -> "ErrorFeedback":
        worker = torch.zeros((layout.world_size, layout.chunk), dtype=torch.float32, device=device)
        server = torch.zeros((1, layout.chunk), dtype=torch.float32, device=device) if with_server else None
        return cls(layout, worker, server)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.layout.kind,
            "numel": self.layout.numel,
            "world_size": self.layout.world_size,
            "worker": self.worker.detach().clone(),
        }
        if self.server is not None:
            out["server"] = self.server.detach().clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs = (state.get("kind"), state.get("numel"), state.get("world_size"))
        ours = (self.layout.kind, self.layout.numel, self.layout.world_size)
        if theirs != ours:
            raise ValueError(
                f"error-feedback state is for (kind, numel, world_size) = {theirs}, this tensor needs {ours}"
            )
        self.worker.copy_(state["worker"])
        if self.server is not None:
            if "server" not in state:
                raise ValueError("error-feedback state lacks the server-side error buffer")
            self.server.copy_(state["server"])
