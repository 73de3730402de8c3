"""Fused multi-tensor Adam (Numba-CUDA) vs torch.optim.AdamW(fused=True) on a GPU.

    python contrib/bench/bench_fused_adam_cuda.py --params 100 --numel 1000000

Reports milliseconds per step and the effective bandwidth (28 bytes per fp32 parameter: read
param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq). Needs a CUDA device.

``--engine`` times what a user's config gets instead: ``engine.step()`` of a zkit engine (ZeRO
stages 1 and 2, fp32 and bf16) over a stack of linear layers, for the config's optimizer types
``"FusedAdam"`` (DeepSpeed's name: torch's fused kernel), ``"fused_adam_cuda"`` (the Numba kernel,
which applies the gradient factor and writes the 16-bit parameters in its one pass) and
``"AdamW"`` (torch's fused kernel, with the gradient scaling and the copy into the 16-bit
parameters as passes of their own)::

    python contrib/bench/bench_fused_adam_cuda.py --engine --layers 24 --width 2048
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


def engine_step_ms(opt_type: str, stage: int, dtype: str, layers: int, width: int, iters: int) -> float:
    """Median milliseconds of ``engine.step()`` (after a backward) for one zkit configuration."""
    import os

    import torch.distributed as dist

    import zkit

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10_000,
              "optimizer": {"type": opt_type, "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zkit.initialize(model=model, config=config)
    times = []
    for i in range(iters + 2):
        x = torch.randn(8, width, device="cuda", dtype=engine.dtype)
        engine.backward(engine(x).float().pow(2).mean())
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.step()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:  # the first steps create the optimizer state
            times.append(start.elapsed_time(end))
    engine.close()
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=100)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine", action="store_true",
                    help="time engine.step() for FusedAdam, fused_adam_cuda and AdamW configs")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_adam_cuda: needs a CUDA device (none found)")
    if args.engine:
        n = args.layers * (args.width * args.width + args.width)
        print(f"engine.step() of {args.layers} x Linear({args.width}, {args.width}): {n / 1e6:.0f}M parameters, "
              f"median of {args.iters} steps, {torch.cuda.get_device_name(0)}")
        print("| ZeRO stage | precision | FusedAdam ms | fused_adam_cuda ms (Numba kernel) | AdamW ms (torch fused) "
              "| fused_adam_cuda / AdamW |")
        print("|---|---|---|---|---|---|")
        for stage, dtype in ((1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")):
            ms = {t: engine_step_ms(t, stage, dtype, args.layers, args.width, args.iters)
                  for t in ("FusedAdam", "fused_adam_cuda", "AdamW")}
            print(f"| {stage} | {dtype} | {ms['FusedAdam']:.3f} | {ms['fused_adam_cuda']:.3f} | {ms['AdamW']:.3f} | "
                  f"{ms['fused_adam_cuda'] / ms['AdamW']:.2f} |", flush=True)
        return
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
