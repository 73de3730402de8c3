"""Fused multi-tensor Adam (Numba-CUDA) vs torch.optim.AdamW(fused=True) on a GPU.

    python contrib/bench/bench_fused_adam_cuda.py --params 100 --numel 1000000

Reports milliseconds per step and the effective bandwidth (28 bytes per fp32 parameter: read
param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq). Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import sys

import torch


def _time(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=100)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_adam_cuda: needs a CUDA device (none found)")
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    def make():
        ps = [torch.randn(args.numel, device="cuda", requires_grad=True) for _ in range(args.params)]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    total = args.params * args.numel
    for name, opt in (("zkit fused_adam_cuda", FusedAdamCUDA(make(), lr=1e-3)),
                      ("torch AdamW(fused=True)", torch.optim.AdamW(make(), lr=1e-3, fused=True))):
        ms = _time(opt.step, args.iters)
        print(f"{name:26s} {ms:8.3f} ms/step  {28 * total / ms / 1e6:8.1f} GB/s")


if __name__ == "__main__":
    main()
