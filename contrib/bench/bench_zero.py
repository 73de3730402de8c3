"""ZeRO benchmark: zkit's stages 0-3 against the textbook memory and traffic volumes, and side by
side with torch DDP, torch ZeroRedundancyOptimizer, torch FSDP2 and DeepSpeed's stages 0-3.

Default mode (a few minutes on 2 CPU cores) measures, on the same GPT, seed and batches:

1. memory: zkit's model-state bytes per rank (``engine.memory()``) for each stage at 2 and 4
   ranks in bf16 mixed precision, against 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N;
2. communication: bytes each rank sends in one step (``engine.comm_stats()``) against 2Ψ / 3Ψ;
3. speed: step time at 2 gloo ranks, one thread each, every contestant built, warmed up, timed and
   torn down in turn, in rounds, so that the machine's noise spreads over all of them; the table
   shows the median over rounds and steps of the slowest rank's step time and the half-range;
4. with ``--phases``, where each rank's step time goes (forward, backward, step, and the time
   zkit's collectives take to issue and to wait for; ``zero_phases.py``).

zkit's stage 3 runs with the config's defaults (``stage3_max_reuse_distance`` 1e9 elements: a model
this size stays gathered from forward into backward, as with DeepSpeed) and, as
``zkit ZeRO-3 reuse=0``, releasing every module after use (the paper's 3Ψ; what the memory and
traffic columns measure).

``--scale`` instead searches the largest GPT each stage trains for 3 steps at 4 ranks under a
memory cap (zkit vs DeepSpeed vs FSDP2); it takes long and uses up to ``--scale-cap-gib`` of RAM.
It also draws step time and peak memory against model size (``--scale-plot``, with matplotlib).

DeepSpeed runs in its own interpreter (``--deepspeed-python``, default ``.venv-peers/bin/python``
when it exists) with ``DS_ACCELERATOR=cpu``; without it the DeepSpeed rows are left out. zkit's
stage 3 row appears when ``zero_optimization.stage = 3`` builds, and says why when it does not.

    OMP_NUM_THREADS=1 python contrib/bench/bench_zero.py                 # memory, traffic, speed
    OMP_NUM_THREADS=1 python contrib/bench/bench_zero.py --rounds 4 --dtypes fp32,bf16
    OMP_NUM_THREADS=1 python contrib/bench/bench_zero.py --micro-batch 4 --phases --skip memory
    OMP_NUM_THREADS=1 python contrib/bench/bench_zero.py --scale --scale-cap-gib 12
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from zero_formulas import model_state_bytes, ring_traffic_bytes, traffic_elements  # noqa: E402
from zero_torch_side import OVERLAP_GATHER, RELEASE, zkit_stage  # noqa: E402
from zero_workloads import DTYPES, Workload, median_and_spread  # noqa: E402

DEFAULT_DS_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-peers", "bin", "python")
STAGES = (0, 1, 2, 3)
GIB = 2**30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    value = int(float(text))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def dtype_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"dtypes must be among {', '.join(DTYPES)}, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("--preset", default="medium", help="GPT preset (zkit.models.gpt.PRESETS); medium: 6 x 512, vocab 8192")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence in speed runs")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per rank per step")
    p.add_argument("--bucket", type=positive_int, default=5_000_000, help="gradient bucket, elements (all contestants)")
    p.add_argument("--world", type=positive_int, default=2, help="ranks for the speed runs")
    p.add_argument("--memory-worlds", type=int_list, default=[2, 4], help="ranks for the memory/traffic runs")
    p.add_argument("--dtypes", type=dtype_list, default=["fp32"], help="precisions timed (fp32, bf16, fp16)")
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds of every contestant")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per contestant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON if os.path.exists(DEFAULT_DS_PYTHON) else None,
                   help="interpreter with DeepSpeed installed (default: %(default)s)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave the DeepSpeed rows out")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: memory, speed")
    p.add_argument("--phases", action="store_true",
                   help="also print where each rank's step time goes (zkit, DDP, ZeroRedundancyOptimizer, FSDP2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one multi-rank job")
    p.add_argument("--scale", action="store_true", help="run the scale search instead (slow; see above)")
    p.add_argument("--scale-cap-gib", type=float, default=12.0, help="RAM cap for the whole scale job (all ranks)")
    p.add_argument("--scale-world", type=positive_int, default=4, help="ranks in scale mode")
    p.add_argument("--scale-depths", type=int_list, default=None, help="GPT depths to try (width 1024)")
    p.add_argument("--scale-stages", type=int_list, default=list(STAGES), help="ZeRO stages searched in scale mode")
    p.add_argument("--scale-plot", default="bench_zero_scale.png",
                   help="PNG of step time and peak memory against model size ('' for none; needs matplotlib)")
    p.add_argument("--scale-host-malloc", type=lambda v: [c for c in v.split(",") if c], default=[],
                   help="add zkit rows with these ZKIT_HOST_MALLOC choices (return, keep; comma-separated); "
                        "the plain rows run at the default, auto")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - {"memory", "speed"}
    if unknown:
        p.error(f"--skip takes memory and/or speed, got {', '.join(sorted(unknown))}")
    if args.no_deepspeed:
        args.deepspeed_python = None
    elif args.deepspeed_python and not os.path.exists(args.deepspeed_python):
        p.error(f"--deepspeed-python {args.deepspeed_python} does not exist")
    return args


# -- running jobs -----------------------------------------------------------------------------------
def run_zkit_side(fn: Any, world: int, fn_args: tuple, timeout: float, env: dict[str, str] | None = None) -> list[Any] | str:
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    try:
        return run_ranks(fn, world, args=fn_args, timeout=timeout, threads_per_rank=1, env=env)
    except (RanksFailed, RanksTimedOut) as exc:
        return str(exc).splitlines()[0]


def run_deepspeed_side(python: str, shim: str, w: Workload, stages: list[int], world: int, timeout: float) -> dict[str, Any]:
    from zero_deepspeed_side import RESULT_PREFIX, deepspeed_command
    from zero_scale import failure_note

    cmd, env = deepspeed_command(
        python,
        ["--mode", "speed", "--world", str(world), "--stages", ",".join(map(str, stages)),
         "--timeout", str(timeout), "--workload", json.dumps(w.to_json())],
        shim,
    )
    names = [f"DeepSpeed ZeRO-{s}" for s in stages]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        return {n: f"timed out after {timeout:.0f} s" for n in names}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return merge_ranks(json.loads(line[len(RESULT_PREFIX):]))
    note = failure_note(proc.stderr)
    return {n: note for n in names}


def merge_ranks(per_rank: list[dict[str, Any]] | str, names: list[str] | None = None) -> dict[str, Any]:
    """Per contestant, the slowest rank's time per step (or the error text)."""
    if isinstance(per_rank, str):
        return {n: per_rank for n in names or []}
    out: dict[str, Any] = {}
    for name, first in per_rank[0].items():
        if isinstance(first, str):
            out[name] = first
        else:
            out[name] = [max(ts) for ts in zip(*(r[name] for r in per_rank))]
    return out


# -- the three default measurements -------------------------------------------------------------------
def measure_state(args: argparse.Namespace) -> tuple[Workload, dict[int, dict[int, Any]]]:
    """bf16 model states and one step's traffic per zkit stage (a short sequence: the bytes do not
    depend on it, and bf16 matmuls are slow on CPUs without bf16 instructions)."""
    from zero_torch_side import state_ranks

    w = Workload(preset=args.preset, seq_len=min(8, args.seq_len), dtype="bf16", bucket_numel=args.bucket)
    out: dict[int, dict[int, Any]] = {}
    for n in args.memory_worlds:
        log(f"memory and traffic, {n} ranks ...")
        result = run_zkit_side(state_ranks, n, (w, list(STAGES)), args.timeout)
        out[n] = {s: result for s in STAGES} if isinstance(result, str) else result[0]
    return w, out


def zkit_contestants() -> list[str]:
    """zkit's stages, then stages 1-2 with the parameter all-gather overlapped with the forward
    and stage 3 releasing every module after use."""
    return ([f"zkit ZeRO-{s}" for s in STAGES] + [f"zkit ZeRO-{s}{OVERLAP_GATHER}" for s in (1, 2)]
            + [f"zkit ZeRO-3{RELEASE}"])


def speed_workload(args: argparse.Namespace, dtype: str) -> Workload:
    return Workload(
        preset=args.preset, seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=dtype,
        bucket_numel=args.bucket, warmup_steps=args.warmup, timed_steps=args.steps,
    )


def measure_phases(args: argparse.Namespace) -> str:
    """The phase breakdown of every zkit contestant and the torch ones, one job per dtype."""
    from zero_phases import phase_ranks, phase_table
    from zero_torch_side import TORCH_CONTESTANTS

    names = zkit_contestants() + list(TORCH_CONTESTANTS)
    tables = []
    for dtype in args.dtypes:
        log(f"phases {dtype} ...")
        result = run_zkit_side(phase_ranks, args.world, (speed_workload(args, dtype), names), args.timeout)
        tables.append(f"{dtype}: {result}" if isinstance(result, str) else f"{dtype}:\n" + phase_table(result, names))
    return "\n\n".join(tables) + (
        f"\nphases: median over {args.steps} steps per rank, ms; 'issue' = starting zkit's collectives, 'wait' = "
        "blocked until they finished (gather: parameter all-gathers; reduce: gradient reduce-scatters and all-reduces)"
    )


def measure_speed(args: argparse.Namespace, shim: str) -> dict[str, dict[str, Any]]:
    """``{dtype: {contestant: [seconds...] | error}}``, rounds interleaved."""
    from zero_torch_side import TORCH_CONTESTANTS, speed_round_ranks

    zkit_names = zkit_contestants()
    out: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        w = speed_workload(args, dtype)
        samples: dict[str, Any] = {}
        for r in range(args.rounds):
            names = zkit_names + list(TORCH_CONTESTANTS)
            if r % 2:
                names.reverse()  # neither side always goes first
            jobs = [("zkit/torch", names)]
            if args.deepspeed_python:
                jobs.insert(r % 2, ("DeepSpeed", list(STAGES)))
            for kind, what in jobs:
                log(f"speed {dtype}, round {r + 1}/{args.rounds}: {kind} ...")
                t0 = time.perf_counter()
                if kind == "DeepSpeed":
                    got = run_deepspeed_side(args.deepspeed_python, shim, w, what, args.world, args.timeout)
                else:
                    got = merge_ranks(run_zkit_side(speed_round_ranks, args.world, (w, what), args.timeout), what)
                log(f"  {time.perf_counter() - t0:.0f} s")
                for name, value in got.items():
                    if isinstance(value, str):
                        samples.setdefault(name, value)
                    elif isinstance(samples.get(name), list) or name not in samples:
                        samples.setdefault(name, []).extend(value)
        out[dtype] = samples
    return out


# -- the table ----------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f}M"


def state_cells(stage: int, psi: int, n: int, info: Any, bucket_bytes: int) -> tuple[str, bool | None]:
    if isinstance(info, str):
        return "n/a", None
    held = sum(info["state"].values())
    formula = model_state_bytes(stage, psi, n)
    ok = held <= 1.05 * formula + bucket_bytes and info["bucket_peak"] <= 2 * bucket_bytes
    text = f"{fmt_bytes(held)} {held / formula:.3f}x"
    if info["bucket_peak"]:
        text += f" +{fmt_bytes(info['bucket_peak'])}b"
    return text, ok


def comm_cells(stage: int, psi: int, n: int, info: Any, elt: int) -> str:
    if isinstance(info, str):
        return "n/a"
    sent = sum(v["bytes"] for v in info["comm"].values())
    paper = traffic_elements(stage, psi) * elt
    ring = ring_traffic_bytes(stage, psi, n, elt)
    return f"{fmt_bytes(sent)} {sent / paper:.3f}x / {sent / ring:.3f}x"


def mark(ok: bool | None) -> str:
    return {True: " ok", False: " MISS", None: ""}[ok]


def build_table(args: argparse.Namespace, state: tuple[Workload, dict] | None, speed: dict[str, dict[str, Any]] | None) -> str:
    names = zkit_contestants() + ["torch DDP", "torch ZeRO-opt", "torch FSDP2"]
    if args.deepspeed_python:
        names += [f"DeepSpeed ZeRO-{s}" for s in STAGES]
    header = ["contestant"]
    for dtype in (speed or {}):
        header += [f"{dtype} step s (±)", "vs DDP", "vs DS"]
    if state:
        for n in state[1]:
            header += [f"state/rank N={n} (x formula)", f"sent/step N={n} (x 2Ψ|3Ψ / x ring)"]
    rows = [header]
    notes: list[str] = []
    for name in names:
        row = [name]
        for dtype, samples in (speed or {}).items():
            value = samples.get(name, "not run")
            if isinstance(value, str):
                row += ["-", "", ""]
                notes.append(f"{name} ({dtype}): {value}")
                continue
            med, spread = median_and_spread(value)
            row.append(f"{med:.3f} (±{spread * 100:.0f}%)")
            ddp = samples.get("torch DDP")
            row.append(f"{med / median_and_spread(ddp)[0]:.2f}" if isinstance(ddp, list) else "")
            if name.startswith("zkit ZeRO-"):
                ds = samples.get(f"DeepSpeed ZeRO-{zkit_stage(name)}")
                row.append(f"{med / median_and_spread(ds)[0]:.2f}" if isinstance(ds, list) else "")
            else:
                row.append("")
        if state:
            w, by_world = state
            psi = w.num_parameters()
            for n, per_stage in by_world.items():
                if name.startswith("zkit ZeRO-") and not name.endswith((OVERLAP_GATHER, RELEASE)):
                    stage = zkit_stage(name)
                    info = per_stage.get(stage, "not run")
                    text, ok = state_cells(stage, psi, n, info, w.bucket_numel * 2)
                    row += [text + mark(ok), comm_cells(stage, psi, n, info, 2)]
                    if isinstance(info, str):
                        notes.append(f"{name} memory at N={n}: {info}")
                else:
                    row += ["", ""]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    if state:
        w = state[0]
        lines.append(
            f"\nmemory/traffic: bf16, Ψ = {w.num_parameters():,} parameters, bucket {w.bucket_numel:,} elements "
            f"({fmt_bytes(w.bucket_numel * 2)}), stage 3 with stage3_max_reuse_distance 0; 'ok' = within 5% of the formula plus one bucket, "
            "'+Xb' = bucket scratch held"
        )
    if speed:
        lines.append(
            f"speed: {args.preset}, {args.world} ranks x 1 thread, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
            f"{args.rounds} rounds x {args.steps} steps; median of the slowest rank's step, ± = half-range / median; "
            "vs DDP / vs DS = time ratio (lower is faster)"
        )
    lines += [f"note: {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines)


# -- scale mode ---------------------------------------------------------------------------------------
def scale_mode(args: argparse.Namespace, shim: str) -> str:
    import zero_scale
    from zero_torch_side import train_ranks

    cap = int(args.scale_cap_gib * GIB)
    world = args.scale_world
    sizes = zero_scale.ladder(tuple(args.scale_depths) if args.scale_depths else zero_scale.DEPTHS)
    contestants: list[tuple[str, int, Any]] = []
    def in_job_cgroup(w: Workload, name: str, env: dict[str, str] | None = None) -> list[Any] | str:
        """The ranks inside one memory cgroup of the cap (every rank also stops itself at its
        share): the limit a job gets from its container or scheduler."""
        from bench_offload_common import CappedRun

        try:
            job = CappedRun(cap)
        except RuntimeError:  # no writable cgroup: the ranks see the machine's memory
            return merge_or_error(run_zkit_side(train_ranks, world, (w, name, cap // world), args.timeout, env))
        with job:
            return merge_or_error(run_zkit_side(
                train_ranks, world, (w, name, cap // world, str(job.dir / "cgroup.procs")), args.timeout, env))

    for s in args.scale_stages:
        contestants.append((f"zkit ZeRO-{s}", s, lambda w, name=f"zkit ZeRO-{s}": in_job_cgroup(w, name)))
        for choice in args.scale_host_malloc:  # zkit's other choices of ZKIT_HOST_MALLOC
            contestants.append((f"zkit ZeRO-{s} ZKIT_HOST_MALLOC={choice}", s, lambda w, name=f"zkit ZeRO-{s}", c=choice:
                                in_job_cgroup(w, name, {"ZKIT_HOST_MALLOC": c})))
        if args.deepspeed_python:
            contestants.append((f"DeepSpeed ZeRO-{s}", s, lambda w, s=s: zero_scale.run_deepspeed_train(
                args.deepspeed_python, shim, w, s, world, cap, args.timeout)))
    if 3 in args.scale_stages:
        contestants.append(("torch FSDP2", 3, lambda w: in_job_cgroup(w, "torch FSDP2")))
    rows = [["contestant", "largest trained", "step s", "peak RSS (all ranks)", "next size", "zkit estimate", "trained / estimate"]]
    searches, estimates = [], {}
    for name, stage, run in contestants:
        log(f"scale: {name}")
        attempts = zero_scale.search(name, stage, run, cap, world, sizes, log)
        searches.append((name, stage, attempts))
        good = [a for a in attempts if a.ok]
        bad = [a for a in attempts if not a.ok]
        best = good[-1] if good else None
        predicted = zero_scale.estimated_largest(stage, world, cap, sizes[0])
        estimates[stage] = predicted.num_parameters()
        rows.append([
            name,
            f"{best.workload.num_parameters() / 1e6:.0f}M ({best.workload.n_layer} layers)" if best else "none",
            f"{best.step_s:.2f}" if best else "",
            f"{best.peak_rss_total / GIB:.2f} GiB" if best else "",
            (f"{bad[0].workload.num_parameters() / 1e6:.0f}M: {bad[0].note}" if bad else "all sizes trained"),
            f"{predicted.num_parameters() / 1e6:.0f}M ({predicted.n_layer} layers)",
            f"{best.workload.num_parameters() / predicted.num_parameters():.2f}" if best else "",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    lines.append(
        f"\nscale: {world} ranks, fp32 + AdamW, GPT width 1024 / 16 heads / vocab 8192, seq 32, micro-batch 1, "
        f"3 steps; cap {args.scale_cap_gib:g} GiB for all ranks together ({args.scale_cap_gib / world:g} GiB per rank)"
    )
    if args.scale_plot:
        lines.append(zero_scale.plot(searches, estimates, cap, world, args.scale_plot))
    return "\n".join(lines)


def merge_or_error(result: list[Any] | str) -> list[Any] | str:
    from zero_scale import failure_note

    return failure_note(result) if isinstance(result, str) else result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="zkit-bench-") as shim:
        t0 = time.perf_counter()
        if args.scale:
            print(scale_mode(args, shim))
        else:
            state = None if "memory" in args.skip else measure_state(args)
            speed = None if "speed" in args.skip else measure_speed(args, shim)
            print(build_table(args, state, speed))
            if args.phases:
                print("\n" + measure_phases(args))
        log(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
