"""Block-sparse attention vs dense SDPA on CPU: forward+backward time and peak memory.

    OMP_NUM_THREADS=1 python contrib/bench/bench_sparse_attention.py --seq 1024 4096 8192 \
        --heads 8 --block 64 --layout fixed bigbird

Each case runs in a fresh subprocess so that its peak resident memory (``ru_maxrss``, minus the
process's baseline) is its own. ``dense`` is PyTorch's SDPA (causal, flash kernel on CPU);
``dense-masked`` is SDPA with the layout passed as an explicit [T, T] mask, which is what a dense
implementation of the same sparsity pattern costs. ``--budget-mib`` finds the longest sequence each
fits in that much memory (doubling the length until it does not fit).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CASE = r"""
import json, resource, sys, time, torch
import torch.nn.functional as F
from zkit_sparse import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
kind, layout, T, H, D, blk, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, T, D, requires_grad=True) for _ in range(3))
nb = T // blk
if layout == "fixed":   # ~10% of the causal triangle at seq 8192 / block 64
    cfg = FixedSparsityConfig(H, block=blk, num_local_blocks=8, num_global_blocks=1, attention="unidirectional")
else:
    cfg = BigBirdSparsityConfig(H, block=blk, num_random_blocks=3, num_sliding_window_blocks=3, num_global_blocks=1)
causal = layout == "fixed"
attn = SparseSelfAttention(cfg, max_seq_length=T, causal=causal)
lay = attn.lut(T, q.device).layout
density = lay.float().mean().item()
if kind == "sparse":
    fn = lambda: attn(q, k, v)
elif kind == "dense":
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
else:
    mask = lay[0].repeat_interleave(blk, 0).repeat_interleave(blk, 1)
    if causal:
        mask &= torch.ones(T, T, dtype=torch.bool).tril()
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(reps):
    t0 = time.perf_counter(); out = fn(); out.sum().backward(); times.append(time.perf_counter() - t0)
    q.grad = k.grad = v.grad = None
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(dict(kind=kind, layout=layout, seq=T, heads=H, block=blk, density=density, seconds=min(times), peak_mib=peak)))
"""


def run_case(kind, layout, seq, heads, dim, block, reps, timeout=1800):
    proc = subprocess.run([sys.executable, "-c", CASE, kind, layout, str(seq), str(heads), str(dim),
                           str(block), str(reps)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--layout", nargs="+", default=["fixed", "bigbird"], choices=["fixed", "bigbird"])
    ap.add_argument("--kinds", nargs="+", default=["sparse", "dense", "dense-masked"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=None)
    args = ap.parse_args()
    rows = []
    for layout in args.layout:
        for seq in args.seq:
            for kind in args.kinds:
                r = run_case(kind, layout, seq, args.heads, args.dim, args.block, args.reps)
                if r:
                    rows.append(r)
                    print(f"{layout:8s} {kind:12s} seq={seq:6d} density={r['density']:.3f} "
                          f"fwd+bwd={r['seconds']:.3f}s peak={r['peak_mib']:.0f}MiB", flush=True)
        if args.budget_mib:
            for kind in args.kinds:
                seq, best = args.seq[0], None
                while seq <= 1 << 20:
                    r = run_case(kind, layout, seq, args.heads, args.dim, args.block, 1)
                    if r is None or r["peak_mib"] > args.budget_mib:
                        break
                    best, seq = seq, seq * 2
                print(f"{layout:8s} {kind:12s} longest seq within {args.budget_mib:.0f} MiB: {best}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
