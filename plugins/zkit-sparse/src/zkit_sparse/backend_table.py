"""Which backend is fastest where: the measured GPU table ``backend="auto"`` follows.

Each row is one case of ``contrib/bench/bench_sparse_attention.py --gpu`` (forward + backward,
bf16, batch 1, 16 heads x 64, 64-token layout blocks): its layout, length, density (present
blocks / all blocks) and the median time of each backend, with dense flash SDPA for reference.
For a CUDA call, ``auto`` takes the measured row nearest in length (on a log scale; ties to the
shorter), then nearest in density, and runs the fastest backend of that row the call can use.
Lengths and densities outside the table are extrapolated from its nearest row: measure them with
the bench and add the rows (docs/plugins/sparse.md renders this table with :func:`markdown`).
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

#: the GPU, torch and command of :data:`GPU_TABLE`
MEASURED_ON = ("one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130: "
               "python contrib/bench/bench_sparse_attention.py --gpu --out-dir results/sparse-gpu --budget-s 170")


class Measured(NamedTuple):
    """One case: forward + backward milliseconds of each backend and of dense flash SDPA."""

    layout: str
    seq: int
    density: float
    ms: dict[str, float]  # backend name (and "dense") -> median milliseconds


GPU_TABLE: tuple[Measured, ...] = (
    Measured("fixed", 4096, 0.156, {"flex": 15.92, "numba": 23.90, "torch": 33.11, "dense": 0.48}),
    Measured("fixed", 16384, 0.133, {"flex": 23.92, "numba": 175.92, "torch": 153.84, "dense": 4.46}),
    Measured("bigbird", 4096, 0.453, {"flex": 2.14, "numba": 30.35, "torch": 48.54, "dense": 0.81}),
    Measured("bigbird", 16384, 0.131, {"flex": 24.43, "numba": 205.54, "torch": 198.02, "dense": 8.21}),
)


def nearest(seq_len: int, density: float, table: Iterable[Measured] = GPU_TABLE) -> Measured:
    """The row nearest ``seq_len`` (log scale, ties to the shorter), then nearest ``density``."""
    return min(table, key=lambda r: (abs(math.log2(seq_len / r.seq)), r.seq, abs(density - r.density)))


def fastest(seq_len: int, density: float, usable: Iterable[str],
            table: Iterable[Measured] = GPU_TABLE) -> str:
    """The fastest of ``usable`` backends in the row nearest ``(seq_len, density)``."""
    row = nearest(seq_len, density, table)
    return min((name for name in usable if name in row.ms), key=row.ms.__getitem__)


def markdown(table: Iterable[Measured] = GPU_TABLE) -> str:
    """The table as docs/plugins/sparse.md shows it: times, then the order ``auto`` follows."""
    lines = ["| layout | seq | density | flex | numba | torch | dense flash SDPA | auto picks (fastest first) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        order = sorted((n for n in r.ms if n != "dense"), key=r.ms.__getitem__)
        lines.append(f"| {r.layout} | {r.seq} | {r.density} | " +
                     " | ".join(f"{r.ms[n]:.2f} ms" for n in ("flex", "numba", "torch", "dense")) +
                     f" | {', '.join(order)} |")
    return "\n".join(lines) + "\n"
