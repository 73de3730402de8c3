"""Numba-CUDA kernels of block-sparse attention: SDD, DSD (plain and transposed), softmax.

Storage (``BG`` = batch x heads sharing one layout, ``T`` = sequence, ``D`` = head dim):

* dense operands ``[BG, Hl * T, D]``: the rows of layout head ``h`` start at ``h * T``;
* sparse blocks ``[BG, nnz, block, block]`` fp32, in the order of the lookup table
  (:mod:`zkit_cuda_numba.block_lut`): nonzero ``n`` is query block ``nz_row[n]`` x key block
  ``nz_col[n]`` of layout head ``nz_head[n]``.

Every matmul kernel computes 16 x 16 output tiles with 16 x 16 threads, staging both operands in
shared memory 16 at a time along the reduction and accumulating in fp32 whatever the input
dtype (fp32 or fp16). Block sizes 16, 32 and 64 are 1, 2 or 4 tiles a side. The softmax kernels
give each query row one thread. Kernels loop over
their tiles grid-stride, so a launch can use fewer thread blocks than tiles (the simulator runs
every thread as a Python thread, so tests launch few).

This module imports numba: import it lazily (:mod:`zkit_cuda_numba.attention` does). Kernels compile
on their first launch, once per argument types.
"""
from __future__ import annotations

import math

from numba import cuda, float32

TILE = 16
TILE_PAD = 17  # shared tiles padded by one column against bank conflicts (a literal: shapes must be constants)
SUPPORTED_BLOCKS = (16, 32, 64)
NEG_INF = float32(-math.inf)


@cuda.jit
def sdd(a, b, out, nz_head, nz_row, nz_col, block, seq, dim):
    """out[bg, n] = A[rows of block nz_row[n]] @ B[rows of block nz_col[n]]^T."""
    sa = cuda.shared.array((TILE, TILE_PAD), float32)
    sb = cuda.shared.array((TILE, TILE_PAD), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    side = block // TILE
    ntiles = out.shape[1] * side * side
    bg = cuda.blockIdx.y
    for t in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
        n = t // (side * side)
        tr = (t // side) % side
        tc = t % side
        head_row = nz_head[n] * seq
        arow = head_row + nz_row[n] * block + tr * TILE
        brow = head_row + nz_col[n] * block + tc * TILE
        acc = float32(0.0)
        for d0 in range(0, dim, TILE):
            d = d0 + tx
            sa[ty, tx] = float32(a[bg, arow + ty, d]) if d < dim else float32(0.0)
            sb[ty, tx] = float32(b[bg, brow + ty, d]) if d < dim else float32(0.0)
            cuda.syncthreads()
            for kk in range(TILE):
                acc += sa[ty, kk] * sb[tx, kk]
            cuda.syncthreads()
        out[bg, n, tr * TILE + ty, tc * TILE + tx] = acc

@cuda.jit
def dsd(sparse, b, out, ptr, nz_index, nz_other, transpose, block, seq, dim):
    """Sparse x dense. Not transposed: for query block row (h, i),
    out[rows of i] = sum over its nonzeros n of sparse[n] @ B[rows of key block nz_col[n]].
    Transposed: for key block column (h, j),
    out[rows of j] = sum over its nonzeros n of sparse[n]^T @ B[rows of query block nz_row[n]].
    ``ptr`` / ``nz_index`` are the row (or column) CSR, ``nz_other`` the block on the other
    side (``nz_col`` or ``nz_row``)."""
    sa = cuda.shared.array((TILE, TILE_PAD), float32)
    sb = cuda.shared.array((TILE, TILE_PAD), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    side = block // TILE
    nb = seq // block
    dtiles = (dim + TILE - 1) // TILE
    ntiles = (ptr.shape[0] - 1) * side * dtiles
    bg = cuda.blockIdx.y
    for t in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
        line = t // (side * dtiles)  # flat (head, block) of the output rows
        tr = (t // dtiles) % side
        n0 = (t % dtiles) * TILE
        head_row = (line // nb) * seq
        col = n0 + tx
        acc = float32(0.0)
        for p in range(ptr[line], ptr[line + 1]):
            nz = nz_index[p]
            brow = head_row + nz_other[nz] * block
            for k0 in range(0, block, TILE):
                if transpose:
                    sa[ty, tx] = sparse[bg, nz, k0 + tx, tr * TILE + ty]
                else:
                    sa[ty, tx] = sparse[bg, nz, tr * TILE + ty, k0 + tx]
                sb[ty, tx] = float32(b[bg, brow + k0 + ty, col]) if col < dim else float32(0.0)
                cuda.syncthreads()
                for kk in range(TILE):
                    acc += sa[ty, kk] * sb[kk, tx]
                cuda.syncthreads()
        if col < dim:
            out[bg, head_row + (line % nb) * block + tr * TILE + ty, col] = acc

@cuda.jit
def softmax_fwd(s, lse, ptr, nz_col, block, seq, scale, kp, am, groups, use_kp, use_am, causal):
    """In place: s[bg, n] <- softmax over each query row of its block row, with the scale,
    causal, key-padding and attention masks fused; lse[bg, h * T + q] <- log-sum-exp.
    A row with every key masked gets zero probabilities and lse = +inf.

    One thread per query row (``block`` threads per block row): an online max/sum pass and a
    write pass, with no barrier. Neighbouring threads read neighbouring rows of the same blocks,
    which stay in L1 between the two passes."""
    r = cuda.threadIdx.x
    nb = seq // block
    lines = ptr.shape[0] - 1
    bg = cuda.blockIdx.y
    for line in range(cuda.blockIdx.x, lines, cuda.gridDim.x):
        qpos = (line % nb) * block + r
        m = NEG_INF
        total = float32(0.0)
        for p in range(ptr[line], ptr[line + 1]):
            for c in range(block):
                kpos = nz_col[p] * block + c
                # the scaled score with the masks fused in (-inf = masked); written out in both
                # passes because a device-function call needs a GPU to compile ahead of time
                x = NEG_INF
                if not (causal and kpos > qpos):
                    x = s[bg, p, r, c] * scale
                    if use_kp:
                        x += kp[bg // groups, kpos]
                    if use_am:
                        x += am[qpos, kpos]
                if x > m:
                    total = total * math.exp(m - x) + float32(1.0)
                    m = x
                elif x != NEG_INF:
                    total += math.exp(x - m)
        inv = float32(1.0) / total if total > 0 else float32(0.0)
        for p in range(ptr[line], ptr[line + 1]):
            for c in range(block):
                kpos = nz_col[p] * block + c
                # the scaled score with the masks fused in (-inf = masked); written out in both
                # passes because a device-function call needs a GPU to compile ahead of time
                x = NEG_INF
                if not (causal and kpos > qpos):
                    x = s[bg, p, r, c] * scale
                    if use_kp:
                        x += kp[bg // groups, kpos]
                    if use_am:
                        x += am[qpos, kpos]
                s[bg, p, r, c] = math.exp(x - m) * inv if x != NEG_INF else float32(0.0)
        lse[bg, (line // nb) * seq + qpos] = m + math.log(total) if total > 0 else -NEG_INF


@cuda.jit
def softmax_bwd(p, dp, ptr, block, scale):
    """In place: dp[bg, n] <- scale * p * (dp - rowsum(p * dp)), one thread per query row."""
    r = cuda.threadIdx.x
    lines = ptr.shape[0] - 1
    bg = cuda.blockIdx.y
    for line in range(cuda.blockIdx.x, lines, cuda.gridDim.x):
        delta = float32(0.0)
        for n in range(ptr[line], ptr[line + 1]):
            for c in range(block):
                delta += p[bg, n, r, c] * dp[bg, n, r, c]
        for n in range(ptr[line], ptr[line + 1]):
            for c in range(block):
                dp[bg, n, r, c] = scale * p[bg, n, r, c] * (dp[bg, n, r, c] - delta)
