"""Scale on one GPU: the largest GPT each contestant trains for 3 steps (loss decreasing) under a
device-memory cap, with host memory as the offload target (ZeRO-Offload's and ZeRO-Infinity's
single-GPU claim).

Contestants, one process each (world size 1), fp32, Adam, one fixed batch of 1 x 64 tokens:

* ``torch``: plain PyTorch on the GPU, ``torch.optim.Adam(fused=True)``;
* ``zkit-opt``: zkit stage 2 with ``offload_optimizer`` on ``cpu`` (ZeRO-Offload: the fp32 master
  and Adam's moments on the host, the parameters and gradients on the GPU);
* ``zkit-cpu``: zkit stage 3 with ``offload_optimizer`` and ``offload_param`` on ``cpu``, the model
  built under ``zkit.zero.Init`` (only the gathered units and activations on the GPU).

The cap is ``torch.cuda.set_per_process_memory_fraction`` (``--cap-gib`` of the device's memory),
set before anything is allocated: the caching allocator refuses an allocation past it with
``torch.OutOfMemoryError``, as a smaller card would. Reported per contestant: parameters, the
allocator's peak (``max_memory_allocated`` and ``max_memory_reserved``), the host's peak RSS and
the step time (the slower of the two steps after the first, which creates the optimizer state).
Each attempt is a child process; depths are tried in the given order until one
fails (``--depths torch=16,20 zkit-cpu=48,96``)::

    python contrib/bench/bench_offload_gpu.py --cap-gib 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "OFFLOAD_GPU_RESULT "
STEPS = 3
#: small enough that 3 steps on one batch lower the loss at every depth tried (1e-3 diverged at 17 layers)
LR = 1e-4
DEFAULT_DEPTHS = {"torch": [12, 16, 18, 20, 22], "zkit-opt": [20, 28, 36, 44], "zkit-cpu": [24, 48, 96, 144]}


def zkit_config(variant: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if variant == "zkit-cpu":
        zero.update(stage=3, offload_param={"device": "cpu", "pin_memory": True},
                    stage3_param_persistence_threshold=10_000, stage3_prefetch_bucket_size=20_000_000,
                    stage3_max_live_parameters=100_000_000, sub_group_size=100_000_000)
    else:
        zero.update(stage=2, reduce_bucket_size=50_000_000)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": zero}


def child(variant: str, layers: int, d_model: int, cap_gib: float) -> dict[str, Any]:
    import torch

    from bench_offload_scale import _peak_rss, gpt_config
    from zkit.models.gpt import GPT

    torch.set_num_threads(os.cpu_count() or 1)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), 0)
    cfg = gpt_config(layers, d_model)
    torch.manual_seed(0)
    phase = "build"
    try:
        if variant == "torch":
            model = GPT(cfg).cuda()
            opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
            params = sum(p.numel() for p in model.parameters())

            def step(batch):
                loss = model(batch, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
        else:
            import zkit

            config = zkit_config(variant)
            if variant == "zkit-cpu":
                with zkit.zero.Init(config=config):
                    model = GPT(cfg)
            else:
                model = GPT(cfg)
            params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            engine, *_ = zkit.initialize(model=model, config=config)
            del model

            def step(batch):
                loss = engine(batch, batch)
                engine.backward(loss)
                engine.step()
                return loss
        batch = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="cuda",
                              generator=torch.Generator("cuda").manual_seed(1))
        phase = "step"
        losses, times = [], []
        for _ in range(STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(step(batch).item())
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"ok": False, "note": f"out of device memory at the cap ({phase})", "params": 0}
    return {"ok": losses[-1] < losses[0], "params": params, "losses": losses, "times": times,
            "allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
            "peak_rss": _peak_rss(), "note": "" if losses[-1] < losses[0] else f"loss did not decrease: {losses}"}


def attempt(variant: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--layers", str(layers),
           "--d-model", str(args.d_model), "--cap-gib", str(args.cap_gib)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return {"ok": False, "note": f"over {args.timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"ok": False, "note": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap-gib", type=float, default=4.0, help="device memory cap per attempt (GiB)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--variants", default="torch,zkit-opt,zkit-cpu")
    p.add_argument("--depths", nargs="*", default=[], help="VARIANT=D1,D2,... (tried in order until one fails)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per attempt")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    if args.child:
        try:
            out = child(args.child, args.layers, args.d_model, args.cap_gib)
        except Exception as exc:  # noqa: BLE001 - the parent reports it as this size's failure
            import traceback

            traceback.print_exc()
            out = {"ok": False, "note": f"{type(exc).__name__}: {exc}"[:300]}
        print(RESULT + json.dumps(out), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_offload_gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    depths = dict(DEFAULT_DEPTHS)
    for item in args.depths:
        name, _, values = item.partition("=")
        depths[name] = [int(v) for v in values.split(",")]
    from bench_offload_scale import steady_step  # the step reported: a step after the first

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"{torch.cuda.get_device_name(0)}, cap {args.cap_gib} GiB of device memory per attempt, "
        f"width {args.d_model}, {os.cpu_count()} CPU threads, load average {os.getloadavg()}")
    rows = []
    for v in [v for v in args.variants.split(",") if v]:
        best, best_layers = None, 0
        for layers in depths[v]:
            r = attempt(v, layers, args)
            log(f"  {v:9s} {layers:4d} layers: " + (
                f"ok, {r['params'] / 1e6:.0f}M params, allocated peak {r['allocated'] / 2**30:.2f} GiB, "
                f"host RSS {r['peak_rss'] / 2**30:.1f} GiB, step {r['times'][steady_step(r['times'])]:.2f} s" if r["ok"]
                else r["note"]))
            if not r["ok"]:
                break
            best, best_layers = r, layers
        rows.append((v, best_layers, best))
    from bench_offload_common import print_size_table

    print(f"\nLargest GPT (d_model {args.d_model}) training {STEPS} steps on {torch.cuda.get_device_name(0)} "
          f"under a {args.cap_gib} GiB device-memory cap")
    print_size_table(rows, [("allocated peak GiB", lambda b: f"{b['allocated'] / 2**30:.2f}"),
                            ("reserved peak GiB", lambda b: f"{b['reserved'] / 2**30:.2f}"),
                            ("host peak RSS GiB", lambda b: f"{b['peak_rss'] / 2**30:.1f}"),
                            ("step s", lambda b: f"{b['times'][steady_step(b['times'])]:.2f}")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
