"""Scale mode: the largest GPT each contestant trains for a few steps at 4 ranks under a memory cap.

The search walks a ladder of GPT depths (fixed width) upwards and stops at the first failure.
Two guards keep the machine safe for everything else running on it:

* a size whose *predicted* model states (the ZeRO formula for fp32 Adam, plus the fp32 model every
  rank builds before sharding) exceed the cap is not started at all;
* every rank runs an :class:`~zero_workloads.RssGuard` at ``cap / world`` and stops itself when
  its resident set passes that, so an attempt that outgrows the prediction dies instead of
  pushing the machine into swap or the OOM killer.

At stage 3 every contestant builds the model sharded from the start, as its users do for a model
larger than one rank: zkit under ``zkit.zero.Init``, DeepSpeed under ``deepspeed.zero.Init``,
FSDP2 on the meta device (sharded, then allocated). Below stage 3 every rank builds the full fp32
model first. Next to each contestant the table prints the size that ``zkit estimate``
(:func:`zkit.estimator.command.estimate_memory`) predicts fits the cap at that stage.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Callable

import attrs

from zero_workloads import Workload

#: resident set of a rank before any model state: interpreter, torch, gloo (measured ~0.4 GiB)
RANK_BASELINE_BYTES = 512 * 2**20

#: depths tried, in order (steps of 1.1-1.5x, finer than doubling); width 1024, 16 heads: about
#: 12.6M parameters per layer
DEPTHS = (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 32, 36, 40, 48, 56, 64)


def ladder(depths: tuple[int, ...] = DEPTHS) -> list[Workload]:
    return [
        Workload(
            preset="medium",
            n_layer=d,
            d_model=1024,
            n_head=16,
            seq_len=32,
            micro_batch=1,
            dtype="fp32",
            warmup_steps=0,
            timed_steps=3,
            # near the memory limit every module is released after use (zkit and DeepSpeed alike)
            stage3_max_reuse_distance=0,
        )
        for d in depths
    ]


def predicted_bytes(stage: int, psi: int, world: int) -> float:
    """Model states of the whole job in fp32 with Adam (4 + 4 + 8 bytes per parameter, the
    parameters being the master; stages 0-2 also build the full fp32 model on every rank, which
    these include), plus each rank's baseline resident set."""
    per_rank = {0: 16.0 * psi, 1: 8.0 * psi + 8.0 * psi / world, 2: 4.0 * psi + 12.0 * psi / world}.get(
        stage, 16.0 * psi / world
    )
    return world * (per_rank + RANK_BASELINE_BYTES)


def estimated_largest(stage: int, world: int, cap_bytes: int, template: Workload) -> Workload:
    """The deepest GPT of ``template``'s width that ``zkit estimate`` says fits ``cap_bytes`` (all
    ranks) at ``stage``: model states plus activations per rank, plus each rank's baseline."""
    from zkit.estimator.command import estimate_memory

    # the workload's stage3_max_reuse_distance when it sets one, else the estimator's (the config's) default
    distance = template.stage3_max_reuse_distance
    reuse = {} if distance is None else {"stage3_max_reuse_distance": distance}

    def fits(depth: int) -> bool:
        w = attrs.evolve(template, n_layer=depth)
        est = estimate_memory(gpt_config=w.gpt_config(), world_sizes=(world,), stages=(stage,), offloads=("none",),
                              dtypes=("fp32",), batch=w.micro_batch, seq=w.seq_len, accelerator=False,
                              reduce_bucket_size=w.bucket_numel, **reuse)
        states = est.rows[0].states
        acts = max(a.peak for a in est.activations if not a.checkpointing)
        return states.device_total + states.host_total + acts + RANK_BASELINE_BYTES <= cap_bytes / world

    depth = 1
    while fits(depth + 1):
        depth += 1
    return attrs.evolve(template, n_layer=depth)


@attrs.define
class Attempt:
    workload: Workload
    ok: bool
    note: str = ""
    step_s: float = float("nan")
    peak_rss_total: int = 0


def search(
    name: str,
    stage: int,
    run: Callable[[Workload], dict[str, Any] | str],
    cap_bytes: int,
    world: int,
    sizes: list[Workload],
    log: Callable[[str], None],
) -> list[Attempt]:
    """Try sizes in order until one fails; ``run(w)`` returns per-rank results or an error text."""
    attempts: list[Attempt] = []
    for w in sizes:
        psi = w.num_parameters()
        if predicted_bytes(stage, psi, world) > cap_bytes:
            attempts.append(Attempt(w, False, "predicted over cap, not started"))
            break
        log(f"  {name}: {psi / 1e6:.0f}M parameters ...")
        result = run(w)
        if isinstance(result, str):
            attempts.append(Attempt(w, False, result))
            break
        per_step = [max(ts) for ts in zip(*(r["times"] for r in result))]
        attempts.append(
            Attempt(w, True, step_s=sorted(per_step)[len(per_step) // 2], peak_rss_total=sum(r["peak_rss"] for r in result))
        )
    return attempts


def run_deepspeed_train(
    python: str, shim_dir: str, w: Workload, stage: int, world: int, cap_bytes: int, timeout: float
) -> dict[str, Any] | str:
    from zero_deepspeed_side import RESULT_PREFIX, deepspeed_command

    cmd, env = deepspeed_command(
        python,
        [
            "--mode", "train", "--world", str(world), "--stage", str(stage),
            "--rss-cap", str(cap_bytes // world), "--timeout", str(timeout),
            "--workload", json.dumps(w.to_json()),
        ],
        shim_dir,
    )
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return failure_note(proc.stderr)


def failure_note(text: str) -> str:
    """A one-line reason from a failed job's output."""
    if "rss guard" in text or "exit code 86" in text:
        return "over the memory cap"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["failed"])[-1][:160]


def plot(searches: list[tuple[str, int, list[Attempt]]], estimates: dict[int, int], cap_bytes: int, world: int,
         path: str) -> str:
    """Step time and peak resident set (all ranks) against parameters, one line per contestant
    (``searches``: name, stage, attempts; the first failed size a cross) and the sizes ``zkit
    estimate`` predicts for the cap (``estimates``: stage -> parameters), to ``path``; see
    :func:`bench_plots.plot_sizes`."""
    from bench_plots import Series, plot_sizes

    series = []
    for name, _stage, attempts in searches:
        good = [a for a in attempts if a.ok]
        failed = [a for a in attempts if not a.ok and "not started" not in a.note]
        series.append(Series(name, [(a.workload.num_parameters(), a.step_s, a.peak_rss_total) for a in good],
                             failed[0].workload.num_parameters() if failed else None))
    marks = {f"zkit estimate, stage {s}": n for s, n in sorted(estimates.items())}
    return plot_sizes(series, cap_bytes, path, f"{world} ranks", "peak RSS, all ranks (GiB)", marks)
