"""zkit's flex backend against a hand-written FlexAttention call: the host's cost per call, on the CPU.

    OMP_NUM_THREADS=1 python contrib/bench/bench_flex_host_overhead.py --seq 1024 --reps 300

Both calls run FlexAttention's compiled forward on the CPU (``flex_compile=True``; the same graph,
``plugins/zkit-sparse/tests/test_flex_same_graph.py``) on q, k, v strided as zkit's GPT passes
them, under ``torch.no_grad()``: the GPU bench's Fixed layout (64-token blocks, 4 local, 1
global, causal) in 128-token tiles, heads and head_dim small so that the host's work is a large
part of each call. After one compiling call each, the two are called alternately and each call's
``time.thread_time()`` (steadier than wall time on a shared machine) is kept; the table gives
the medians and zkit's over the hand-written call's, and the aten ops each dispatches per call
outside the compiled graph.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from zkit.testing import OpsOutsideCompiledGraphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from zkit_sparse import FixedSparsityConfig, SparseSelfAttention

    cfg = FixedSparsityConfig(ns.heads, block=64, num_local_blocks=4, num_global_blocks=1,
                              attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=ns.seq, backend="flex", flex_compile=True)
    layout = attn.layout(ns.seq)[0].bool()

    def token_mask(b, h, q_idx, kv_idx):
        return layout[q_idx // 64, kv_idx // 64] & (q_idx >= kv_idx)

    block_mask = create_block_mask(token_mask, 1, 1, ns.seq, ns.seq, device="cpu", BLOCK_SIZE=128)
    hand = torch.compile(flex_attention, dynamic=False)
    qkv = torch.randn(1, ns.seq, 3, ns.heads, ns.dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    calls = {"hand-written": lambda: hand(q, k, v, block_mask=block_mask), "zkit flex": lambda: attn(q, k, v)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    ops = {}
    with torch.no_grad():
        for name, call in calls.items():
            first = time.perf_counter()
            call()
            print(f"{name}: first call (compile) {time.perf_counter() - first:.1f} s", flush=True)
            with OpsOutsideCompiledGraphs() as mode:
                call()
            ops[name] = len(mode.ops)
        for _ in range(ns.reps):
            for name, call in calls.items():
                t0 = time.thread_time()
                call()
                times[name].append(time.thread_time() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nseq {ns.seq}, {ns.heads} heads x {ns.dim}, {ns.reps} calls each, torch {torch.__version__}\n")
    print("| call | median per call (thread time) | x hand-written | aten ops outside the graph |")
    print("|---|---|---|---|")
    for name in calls:
        print(f"| {name} | {med[name] * 1e6:.0f} us | {med[name] / med['hand-written']:.3f} | {ops[name]} |")


if __name__ == "__main__":
    main()
