"""What returning freed host memory to the system costs in step time and saves in resident memory
(see zkit/host_memory/malloc_policy.py): a stage-3 GPT (4 x 1024, micro-batch 4 x 128) on 2 gloo ranks x 1
thread, each setting in its own job, rounds alternating. Settings: ``keep`` (glibc's moving
threshold), ``return`` (threshold fixed at 1 MiB; what ``auto`` chooses near the memory limit) and
``keep`` with ``malloc_trim`` after every step (the alternative zkit does not take).

    OMP_NUM_THREADS=1 python contrib/bench/bench_host_malloc.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def ranks(stage: int, steps: int, trim_each_step: bool) -> tuple[list[float], int]:
    """One rank: build the engine, time ``steps`` steps (the first 2 untimed); its peak RSS (KiB)."""
    import resource

    import attrs
    import torch

    import zero_scale
    import zero_torch_side
    from zero_workloads import batches

    torch.set_num_threads(1)
    w = attrs.evolve(zero_scale.ladder()[0], n_layer=4, seq_len=128, micro_batch=4, stage3_max_reuse_distance=0)
    engine = zero_torch_side.build_zkit(w, f"zkit ZeRO-{stage}")
    times = []
    for b in batches(w, torch.distributed.get_rank(), steps + 2):
        t = time.perf_counter()
        engine.backward(engine(b, b))
        engine.step()
        if trim_each_step:
            _malloc_trim(0)
        times.append(time.perf_counter() - t)
    engine.close()
    return times[2:], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _malloc_trim(pad: int) -> int:
    import ctypes

    return ctypes.CDLL("libc.so.6").malloc_trim(pad)


def _job(stage: int, steps: int, trim_each_step: bool) -> None:
    from zkit.testing import run_ranks

    results = run_ranks(ranks, 2, args=(stage, steps, trim_each_step), timeout=900)
    slowest = [max(ts) for ts in zip(*(times for times, _ in results))]
    print("RESULT " + json.dumps({"steps": slowest, "peak_rss_kib": max(rss for _, rss in results)}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trim-each-step", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        _job(args.stage, args.steps, args.trim_each_step)
        return
    settings = {"keep": ("keep", False), "return": ("return", False), "keep + trim each step": ("keep", True)}
    runs: dict[str, list[dict]] = {k: [] for k in settings}
    for _ in range(args.rounds):
        for name, (value, trim) in settings.items():
            env = dict(os.environ, OMP_NUM_THREADS="1", ZKIT_HOST_MALLOC=value)
            out = subprocess.run([sys.executable, __file__, "--job", "--stage", str(args.stage), "--steps",
                                  str(args.steps)] + (["--trim-each-step"] if trim else []),
                                 env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    print(f"ZeRO-{args.stage}, 2 ranks, {args.rounds} rounds x {args.steps} timed steps (slowest rank)")
    print(f"{'setting':<24}{'median step s':>14}{'peak RSS MiB':>14}")
    med = {}
    for name, rs in runs.items():
        med[name] = statistics.median(t for r in rs for t in r["steps"])
        print(f"{name:<24}{med[name]:>14.3f}{max(r['peak_rss_kib'] for r in rs) // 1024:>14}")
    for name in list(settings)[1:]:
        print(f"{name} / keep step time: {med[name] / med['keep']:.2f}x")


if __name__ == "__main__":
    main()
