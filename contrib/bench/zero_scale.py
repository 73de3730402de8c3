"""Scale mode: the largest GPT each contestant trains for a few steps at 4 ranks under a memory cap.

The search walks a ladder of GPT depths (fixed width) upwards and stops at the first failure.
Two guards keep the machine safe for everything else running on it:

* a size whose *predicted* model states (the ZeRO formula for fp32 Adam, plus the fp32 model every
  rank builds before sharding) exceed the cap is not started at all;
* every rank runs an :class:`~zero_workloads.RssGuard` at ``cap / world`` and stops itself when
  its resident set passes that, so an attempt that outgrows the prediction dies instead of
  pushing the machine into swap or the OOM killer.

Every rank builds the full fp32 model before the engine shards it (no ``zero.Init`` /
meta-device construction), for every contestant alike; so at stage 3 the limit found is the
construction peak of ``4Ψ`` per rank rather than ``16Ψ/N``.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Callable

import attrs

from zero_workloads import Workload

#: resident set of a rank before any model state: interpreter, torch, gloo (measured ~0.4 GiB)
RANK_BASELINE_BYTES = 512 * 2**20

#: depths tried, in order; width 1024, 16 heads: about 12.6M parameters per layer
DEPTHS = (2, 4, 8, 16, 24, 32, 48, 64)


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
        )
        for d in depths
    ]


def predicted_bytes(stage: int, psi: int, world: int) -> float:
    """Model states of the whole job in fp32 with Adam (4 + 4 + 8 bytes per parameter, the
    parameters being the master), at least the full fp32 model each rank builds first, plus each
    rank's baseline resident set."""
    per_rank = {0: 16.0 * psi, 1: 8.0 * psi + 8.0 * psi / world, 2: 4.0 * psi + 12.0 * psi / world}.get(
        stage, 16.0 * psi / world
    )
    return world * (max(per_rank, 4.0 * psi) + RANK_BASELINE_BYTES)


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
