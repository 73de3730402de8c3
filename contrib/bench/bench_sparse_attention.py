"""Block-sparse attention vs dense attention on CPU: forward+backward time and peak memory.

    OMP_NUM_THREADS=1 python contrib/bench/bench_sparse_attention.py time --seq 8192 \
        --heads 8 12 --block 32 64 --layout fixed bigbird
    OMP_NUM_THREADS=1 python contrib/bench/bench_sparse_attention.py memory --budget-mib 2048
    python contrib/bench/bench_sparse_attention.py --gpu --out-dir results/sparse-gpu
    python contrib/bench/bench_sparse_attention.py --cpu-smoke --out-dir /tmp/sparse-smoke
    python contrib/bench/bench_sparse_attention.py --geometry

``--gpu`` runs the GPU table (backends flex, numba, torch against flash SDPA and a hand-written
FlexAttention call, and the longest GPT sequence) in one process within ``--budget-s``; it writes
``table.md`` and ``rows.jsonl`` under ``--out-dir`` (see ``sparse_attention_gpu.py``).
``--cpu-smoke`` runs the same code on tiny CPU shapes, to check the script. ``--families`` and
``--seq`` restrict the GPU table's layouts and lengths (a rerun of what the budget skipped).
``--geometry`` prints the GPU table's layouts' density and FlexAttention tiles at its lengths
(computed on the CPU, no timing).

Variants:
  sparse          zkit's block-sparse path, probabilities kept for the backward (the default)
  sparse-recomp   the same with save_probs=False (probabilities recomputed in the backward)
  dense           PyTorch SDPA, causal for unidirectional layouts (a flash kernel on CPU:
                  memory linear in the sequence, but it computes every block)
  dense-masked    SDPA with the layout materialised as a [T, T] boolean mask: what the same
                  sparsity pattern costs with dense attention
  dense-eager     softmax(Q K^T / sqrt(d) + mask) V written out, the scores materialised per head
                  (attention before fused kernels, and DeepSpeed's baseline for its sparse
                  attention's "longer sequences" figures): memory quadratic in the sequence

Layouts hold ~10 % of the blocks at seq 8192 with the same token pattern at block 32 and 64:
fixed (unidirectional, 512-token local windows, 64 global tokens per window) and bigbird
(~450-token sliding window, random blocks, one global block).

``time`` runs every variant of one case in one process, interleaved, and reports medians of
process CPU time (robust on a shared machine) and wall time, with the load average.
``memory`` runs each (variant, seq) in a fresh process and reports the resident-memory high-water
mark above the process's resident size before the call; the longest sequence within the budget
is the longest measured one that fits, and a least-squares fit ``a + b*T + c*T^2`` of the
measurements extrapolates where each variant would reach the budget.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

VARIANTS = ("sparse", "sparse-recomp", "dense", "dense-masked", "dense-eager")

CASE = r"""
import json, os, resource, sys, time
import torch
import torch.nn.functional as F
from zkit_sparse import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
T, H, D, blk = args["seq"], args["heads"], args["dim"], args["block"]
scale_ = 64 // blk   # same token pattern at block 32 and 64
if args["layout"] == "fixed":
    cfg = FixedSparsityConfig(H, block=blk, num_local_blocks=8 * scale_, num_global_blocks=scale_,
                              attention="unidirectional")
else:
    cfg = BigBirdSparsityConfig(H, block=blk, num_random_blocks=4 * scale_,
                                num_sliding_window_blocks=7 * scale_ + scale_ - 1,
                                num_global_blocks=scale_)
causal = args["layout"] == "fixed"


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, H, T, D, generator=gen).requires_grad_() for _ in range(3))
sparse = {n: SparseSelfAttention(cfg, max_seq_length=T, causal=causal, save_probs=(n == "sparse"))
          for n in ("sparse", "sparse-recomp")}
layout = sparse["sparse"].lut(T, q.device).layout
density = layout.float().mean().item()
mask = None


def call(name):
    global mask
    if name in sparse:
        return sparse[name](q, k, v)
    if name == "dense":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if mask is None:
        mask = layout[0].repeat_interleave(blk, 0).repeat_interleave(blk, 1)
        if causal:
            mask &= torch.ones(T, T, dtype=torch.bool).tril()
    if name == "dense-eager":
        scores = (q @ k.transpose(-1, -2)) * D**-0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def step(name):
    out = call(name)
    out.backward(torch.ones_like(out))
    q.grad = k.grad = v.grad = None


if args["mode"] == "memory":
    (name,) = args["variants"]
    before = rss_bytes()
    high_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(name)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(variant=name, seq=T, density=density,
                          peak_mib=(peak - max(before, high_before)) / 2**20,
                          exact=high_before <= before + 2**20)))
else:
    times = {n: [] for n in args["variants"]}
    for rep in range(args["reps"] + 1):  # the first round warms up (layout, buffers)
        for name in args["variants"]:
            c0, w0 = time.process_time(), time.perf_counter()
            step(name)
            if rep:
                times[name].append((time.process_time() - c0, time.perf_counter() - w0))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(json.dumps(dict(density=density, load=os.getloadavg()[0],
                          cpu={n: med([c for c, _ in t]) for n, t in times.items()},
                          wall={n: med([w for _, w in t]) for n, t in times.items()})))
"""


def run_case(args: dict, timeout: float = 3600) -> dict | None:
    proc = subprocess.run([sys.executable, "-c", CASE, json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        print(f"  {args['variants']} seq={args['seq']}: failed: {proc.stderr.strip()[-300:]}",
              file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_table(ns) -> list[dict]:
    rows = []
    print(f"| layout | seq | heads | block | density | " + " | ".join(ns.variants) +
          " | dense / sparse (CPU) | dense / sparse (wall) | load |")
    print("|---" * (len(ns.variants) + 8) + "|")
    for layout in ns.layout:
        for seq in ns.seq:
            for heads in ns.heads:
                for block in ns.block:
                    case = dict(mode="time", layout=layout, seq=seq, heads=heads, dim=ns.dim,
                                block=block, reps=ns.reps, threads=ns.threads,
                                variants=list(ns.variants))
                    r = run_case(case)
                    if r is None:
                        continue
                    cells = [f"{r['cpu'][v]:.2f} s" for v in ns.variants]
                    ratio = lambda key: (f"{r[key]['dense'] / r[key]['sparse']:.2f}"  # noqa: E731
                                         if {"dense", "sparse"} <= set(r[key]) else "-")
                    print(f"| {layout} | {seq} | {heads} | {block} | {r['density']:.3f} | "
                          + " | ".join(cells) + f" | {ratio('cpu')} | {ratio('wall')} | "
                          f"{r['load']:.1f} |", flush=True)
                    rows.append(dict(case, **r))
    return rows


def memory_table(ns) -> list[dict]:
    rows = []
    budget = ns.budget_mib
    print(f"| layout | variant | " + " | ".join(f"seq {s}" for s in ns.seq) +
          f" | longest measured within {budget:.0f} MiB | fitted seq at {budget:.0f} MiB |")
    print("|---" * (len(ns.seq) + 4) + "|")
    for layout in ns.layout:
        for variant in ns.variants:
            points = []
            for seq in ns.seq:
                case = dict(mode="memory", layout=layout, seq=seq, heads=ns.heads[0], dim=ns.dim,
                            block=ns.block[0], reps=1, threads=ns.threads, variants=[variant])
                r = run_case(case)
                if r is not None:
                    points.append((seq, r["peak_mib"]))
                    rows.append(dict(case, **r))
            fits = [s for s, m in points if m <= budget]
            cells = {s: f"{m:.0f} MiB" for s, m in points}
            print(f"| {layout} | {variant} | " + " | ".join(cells.get(s, "-") for s in ns.seq) +
                  f" | {max(fits) if fits else '-'} | {fitted_limit(points, budget)} |", flush=True)
    return rows


def fitted_limit(points: list[tuple[int, float]], budget: float) -> str:
    """Where ``a + b*T + c*T^2`` (least squares over the measurements) reaches ``budget``."""
    if len(points) < 3:
        return "-"
    t = np.array([p[0] for p in points], dtype=float)
    m = np.array([p[1] for p in points])
    c2, c1, c0 = np.polyfit(t, m, 2)
    roots = [r.real for r in np.roots([max(c2, 0.0), c1, c0 - budget]) if abs(r.imag) < 1e-9 and r.real > 0] \
        if c2 > 0 else ([(budget - c0) / c1] if c1 > 0 else [])
    return f"~{int(min(roots)):,}" if roots else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["time", "memory"])
    ap.add_argument("--gpu", action="store_true", help="the GPU table (one CUDA device)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the GPU table's code on tiny CPU shapes")
    ap.add_argument("--geometry", action="store_true",
                    help="the GPU table's layouts: density and FlexAttention tiles (CPU, no timing)")
    ap.add_argument("--families", nargs="+", default=None,
                    help="--gpu/--cpu-smoke: the layouts to time (default: all of the table's)")
    ap.add_argument("--out-dir", default="sparse-attention-gpu", help="--gpu/--cpu-smoke: where the table goes")
    ap.add_argument("--budget-s", type=float, default=270.0, help="--gpu: no case starts after this many seconds")
    ap.add_argument("--stages", nargs="+", default=["kernels", "fp32", "gpt"], choices=["kernels", "fp32", "gpt"])
    ap.add_argument("--gpt-step-cap-s", type=float, default=10.0,
                    help="--gpu: stop lengthening the GPT once a step takes longer")
    ap.add_argument("--seq", type=int, nargs="+", default=None)
    ap.add_argument("--heads", type=int, nargs="+", default=[8])
    ap.add_argument("--block", type=int, nargs="+", default=[64], choices=[32, 64])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layout", nargs="+", default=["fixed", "bigbird"], choices=["fixed", "bigbird"])
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-mib", type=float, default=2048.0)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ns = ap.parse_args()
    if ns.gpu or ns.cpu_smoke or ns.geometry:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sparse_attention_gpu

        if ns.geometry:
            print(sparse_attention_gpu.geometry(ns.families))
            return
        sparse_attention_gpu.main(ns.out_dir, smoke=ns.cpu_smoke, budget_s=ns.budget_s,
                                  reps=max(ns.reps, 20) if ns.gpu else 3, stages=ns.stages,
                                  step_cap_s=ns.gpt_step_cap_s, families=ns.families, seqs=ns.seq)
        return
    if ns.mode is None:
        ap.error("give a mode (time, memory) or --gpu / --cpu-smoke")
    if ns.mode == "time":
        ns.seq = ns.seq or [8192]
        ns.variants = ns.variants or ["sparse", "sparse-recomp", "dense"]
        rows = time_table(ns)
    else:
        ns.seq = ns.seq or [2048, 4096, 8192, 16384]
        ns.variants = ns.variants or list(VARIANTS)
        rows = memory_table(ns)
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} cores, {ns.threads} thread(s) per run")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
