"""CPU Adam step time: zkit-offload's fused kernel against torch and DeepSpeed, side by side.

Two cases per size:

* **plain**: an fp32 Adam step (what ``torch.optim.Adam(fused=True)`` does).
* **mixed**: the mixed-precision step of an fp16 run with offloaded optimizer: gradients scaled by
  the loss scale are checked for inf/nan, unscaled, Adam steps, and the updated parameters are
  written as bf16. zkit does it in two passes (read-only check, fused step with copy-out); torch
  in three (``_amp_foreach_non_finite_check_and_unscale_``, fused step, ``copy_``).

Implementations are timed in interleaved rounds (best of ``--rounds``) so that noise from other
processes hits all of them alike. DeepSpeedCPUAdam needs DeepSpeed, usually in its own virtual
environment: ``--deepspeed-python /path/to/venv/bin/python`` runs the DeepSpeed rows with that
interpreter (this same script, ``--only-deepspeed``) and merges them into the table.

    OMP_NUM_THREADS=2 python contrib/bench/bench_cpu_adam.py --sizes 10e6,100e6 \
        --deepspeed-python /tmp/dsvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable

import torch

BYTES_PER_PARAM = 28  # Adam fp32: read p, g, m, v (16) and write p, m, v (12)
SCALE = 1024.0


def best_of(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up: JIT load, first-touch of state
    times = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t)
    return times


def memory_bandwidth(n: int, rounds: int) -> float:
    """Best read+write GB/s of a large copy (the ceiling for a streaming kernel)."""
    src, dst = torch.randn(n), torch.empty(n)
    t = best_of({"copy": lambda: dst.copy_(src)}, rounds)["copy"]
    return 8 * n / t / 1e9


def make_param(n: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    return p


def torch_mixed(opt: torch.optim.Optimizer, p: torch.nn.Parameter, p16: torch.Tensor) -> Callable[[], None]:
    found_inf = torch.zeros(1)
    # Unscaling by 1 moves the same bytes as by 1/scale and keeps the gradient from shrinking
    # towards denormals over the rounds (torch unscales in place; zkit leaves the gradient as is).
    inv = torch.ones(1)

    def run() -> None:
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad], found_inf, inv)
        if not found_inf.item():
            opt.step()
            p16.copy_(p.detach())

    return run


def zkit_rows(n: int, rounds: int) -> dict[str, float]:
    from zkit_offload import CPUAdam

    out = {}
    impls: dict[str, Callable[[], None]] = {}
    keep = []
    for name, factory in [
        ("zkit CPUAdam", lambda ps: CPUAdam(ps, backend="numba")),
        ("torch Adam fused", lambda ps: torch.optim.Adam(ps, fused=True)),
        ("torch Adam foreach", lambda ps: torch.optim.Adam(ps, foreach=True)),
    ]:
        p = make_param(n)
        opt = factory([p])
        keep.append((p, opt))
        impls[name] = opt.step
    for k, v in best_of(impls, rounds).items():
        out[f"plain | {k}"] = v
    del keep, impls

    impls, keep = {}, []
    p = make_param(n)
    zk = CPUAdam([p], backend="numba")
    p16 = torch.empty(n, dtype=torch.bfloat16)
    zk.attach_copy_out(p, p16)

    def zkit_mixed() -> None:
        zk.fused_step(grad_factor=1.0 / SCALE, check_overflow=True)

    impls["zkit CPUAdam"] = zkit_mixed
    q = make_param(n)
    impls["torch Adam fused"] = torch_mixed(torch.optim.Adam([q], fused=True), q, torch.empty(n, dtype=torch.bfloat16))
    keep += [p, q]
    for k, v in best_of(impls, rounds).items():
        out[f"mixed | {k}"] = v
    return out


def deepspeed_rows(n: int, rounds: int) -> dict[str, float]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = make_param(n)
    plain = DeepSpeedCPUAdam([p], adamw_mode=False)
    r = make_param(n)
    ref = torch.optim.Adam([r], fused=True)  # timed alongside, to put DeepSpeed on zkit's scale
    t = best_of({"plain": plain.step, "ref": ref.step}, rounds)
    del plain, ref, p, r
    q = make_param(n)
    mixed = torch_mixed(DeepSpeedCPUAdam([q], adamw_mode=False), q, torch.empty(n, dtype=torch.bfloat16))
    r = make_param(n)
    ref_mixed = torch_mixed(torch.optim.Adam([r], fused=True), r, torch.empty(n, dtype=torch.bfloat16))
    tm = best_of({"mixed": mixed, "ref": ref_mixed}, rounds)
    # Rows are expressed relative to torch fused timed in the same process and round-robin.
    return {"plain | DeepSpeedCPUAdam": t["plain"] / t["ref"], "mixed | DeepSpeedCPUAdam": tm["mixed"] / tm["ref"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6,100e6", help="comma-separated parameter counts")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--deepspeed-python", default=None, help="interpreter with DeepSpeed installed")
    ap.add_argument("--only-deepspeed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if args.only_deepspeed:
        print(json.dumps({str(n): deepspeed_rows(n, args.rounds) for n in sizes}))
        return

    ds: dict[str, dict[str, float]] = {}
    if args.deepspeed_python:
        cmd = [args.deepspeed_python, __file__, "--only-deepspeed", "--sizes", args.sizes, "--rounds", str(args.rounds)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        if res.returncode == 0:
            ds = json.loads(res.stdout.strip().splitlines()[-1])
        else:
            print(f"DeepSpeed rows failed:\n{res.stderr[-2000:]}", file=sys.stderr)
    else:
        try:
            for n in sizes:
                ds[str(n)] = deepspeed_rows(n, args.rounds)
        except ImportError:
            print("DeepSpeed not importable: no DeepSpeedCPUAdam rows (see --deepspeed-python)")

    bw = memory_bandwidth(50_000_000, args.rounds)
    print(f"threads: torch {torch.get_num_threads()}; measured copy bandwidth {bw:.1f} GB/s (read+write)")
    for n in sizes:
        rows = zkit_rows(n, args.rounds)
        for key, rel in ds.get(str(n), {}).items():  # DeepSpeed relative to torch fused in its process
            rows[key] = rel * rows[f"{key.split(' | ')[0]} | torch Adam fused"]
        print(f"\n{n / 1e6:.0f}M params")
        print(f"{'case | implementation':40s} {'ms/step':>9s} {'GB/s':>7s} {'% bw':>6s} {'zkit speed-up':>14s}")
        for key, t in rows.items():
            case = key.split(" | ")[0]
            zkit = rows[f"{case} | zkit CPUAdam"]
            gbs = BYTES_PER_PARAM * n / t / 1e9
            print(f"{key:40s} {t * 1e3:9.2f} {gbs:7.1f} {100 * gbs / bw:6.0f} {t / zkit:13.2f}x")
    print("\nDeepSpeed rows: its time relative to torch fused (timed alternately in the DeepSpeed process),"
          " scaled by torch fused's time here.")
    print("GB/s counts 28 bytes/param for both cases (the Adam step alone); zkit speed-up = time / zkit time.")


if __name__ == "__main__":
    main()
