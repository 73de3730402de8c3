"""The lookup table the block-sparse kernels run on, built once per layout.

Nonzero blocks are numbered in (layout head, query block, key block) order, so the row CSR
(``row_ptr``) indexes them directly; the column CSR (``col_ptr``, ``col_nz``) lists, for each
(layout head, key block), the nonzeros in that column for the transposed products of the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelLUT:
    block: int
    seq: int
    layout_heads: int
    nz_head: torch.Tensor  #: [nnz] int32
    nz_row: torch.Tensor  #: [nnz] int32 query block of each nonzero
    nz_col: torch.Tensor  #: [nnz] int32 key block of each nonzero
    row_ptr: torch.Tensor  #: [Hl * nb + 1] int32
    row_nz: torch.Tensor  #: [nnz] int32 (identity: nonzeros are stored row by row)
    col_ptr: torch.Tensor  #: [Hl * nb + 1] int32
    col_nz: torch.Tensor  #: [nnz] int32 nonzero indices column by column

    @property
    def nnz(self) -> int:
        return self.nz_head.numel()


def build_kernel_lut(layout: torch.Tensor, block: int, device: torch.device | str = "cpu") -> KernelLUT:
    """CSR tables of ``layout`` ([Hl, nb, nb], nonzero = present) on ``device``."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"a layout must be [heads, num_blocks, num_blocks], got {tuple(layout.shape)}")
    present = layout.detach().to("cpu") != 0
    heads, nb, _ = present.shape
    h, i, j = present.nonzero(as_tuple=True)  # row-major: sorted by (h, i, j)
    lines = heads * nb
    row_counts = torch.bincount(h * nb + i, minlength=lines)
    col_key = h * nb + j
    col_nz = torch.argsort(col_key * nb + i)  # by (h, j, i)
    col_counts = torch.bincount(col_key, minlength=lines)

    def ptr(counts):
        return torch.cat([torch.zeros(1, dtype=torch.int64, device=counts.device), counts.cumsum(0)])

    def dev(t):
        return t.to(device=device, dtype=torch.int32).contiguous()

    return KernelLUT(
        block=block, seq=nb * block, layout_heads=heads,
        nz_head=dev(h), nz_row=dev(i), nz_col=dev(j),
        row_ptr=dev(ptr(row_counts)), row_nz=dev(torch.arange(h.numel(), device="cpu")),
        col_ptr=dev(ptr(col_counts)), col_nz=dev(col_nz),
    )
