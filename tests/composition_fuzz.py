"""The composition fuzzer: sets of 3-5 features drawn from composition_fuzz_model.py, each of which
must equal its reference or be refused at initialize with an error naming one of its refused pairs.

    python tests/composition_fuzz.py --examples 40 [--seed 1] [--no-shrink]

draws the sets with the model's hypothesis strategy (deterministically for a seed), runs them and
their references in one 2-rank process group, then shrinks every failing set by removing one
feature at a time while it still fails (each round's candidates in one process group too), and
prints each failure as its minimal set. ``tests/test_composition_fuzz.py`` runs a fixed subset.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import composition_fuzz_model as fuzz  # noqa: E402


def draw(examples: int, seed: int) -> list[tuple[str, ...]]:
    """``examples`` distinct feature sets from the model's strategy, the same for a seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn: list[tuple[str, ...]] = []

    @hypothesis_seed(seed)
    @settings(max_examples=examples * 4, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(fuzz.feature_sets())
    def collect(features):
        if "ds_import" in features and deepspeed_missing():
            return
        if features not in drawn and len(drawn) < examples:
            drawn.append(features)

    collect()
    return drawn


PEER_PYTHON = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python"


def deepspeed_missing() -> str | None:
    """Why ``ds_import`` cannot run here, or ``None``."""
    if not PEER_PYTHON.exists():
        return f"no DeepSpeed peer environment at {PEER_PYTHON} (build it with `make peers`)"
    return None


def _peer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def run_deepspeed(sets: list[tuple[str, ...]], root: str) -> str:
    """DeepSpeed's checkpoints of the ``ds_import`` sets (one peer process group for all)."""
    runs = sorted({fuzz.deepspeed_run(s) for s in sets} - {None})
    out = tempfile.mkdtemp(dir=root)
    if runs:
        proc = subprocess.run([str(PEER_PYTHON), str(Path(__file__).with_name("composition_fuzz_peer.py")),
                               "--out", out, "--runs", json.dumps(runs)],
                              env=_peer_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"DeepSpeed's side of ds_import failed ({proc.returncode}):\n{tail}")
    return out


def run(sets: list[tuple[str, ...]], root: str) -> dict[tuple[str, ...], dict]:
    """Each set's result and its reference's, in one 2-rank process group; a set that leaves a rank
    behind (hung in a collective) is recorded as such and the group starts again after it."""
    import composition_fuzz_ranks
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    twins = sorted({fuzz.overlap_twin(s) for s in sets if not fuzz.refused_pairs(s)} - {None})
    cells = list(dict.fromkeys([*sorted({fuzz.reference_of(s) for s in sets}), *sets, *twins]))
    nvme, ckpt, ds = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root), run_deepspeed(sets, root)
    results: dict = {}
    while cells:
        partial = os.path.join(tempfile.mkdtemp(dir=root), "partial-{rank}.pkl")
        try:
            results.update(run_ranks(composition_fuzz_ranks.run_sets, 2, args=(cells, nvme, ckpt, ds, partial),
                                     timeout=1800)[0])
            break
        except (RanksFailed, RanksTimedOut) as exc:
            # a set left the ranks apart (hung, or gloo aborted on mismatched collectives): what
            # both ranks finished stands, that set failed, the rest runs in a new group
            done = [_load(partial.format(rank=r)) for r in range(2)]
            finished = min(len(d) for d in done)
            if finished == len(cells):  # not a set's doing: the group died as it left
                raise RuntimeError(f"every set finished, then a rank died: {exc}") from exc
            results.update({s: done[0][s] for s in cells[:finished]})
            results[cells[finished]] = {"crashed": "the ranks did not both finish it: " + str(exc)[-2000:]}
            cells = cells[finished + 1:]
    return results


def _load(path: str) -> dict:
    import pickle

    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        return pickle.load(f)


def verdict(features: tuple[str, ...], results: dict) -> str | None:
    """Why ``features`` failed, or ``None``."""
    got, pairs = results[features], fuzz.refused_pairs(features)
    if "crashed" in got:
        if got["crashed"].startswith("the ranks"):  # apart: one refused or raised, another went on
            return got["crashed"]
        return f"accepted at initialize, then crashed:\n{got['crashed']}"
    if pairs:
        if "refused" not in got:
            return f"trained, but {pairs} must be refused at initialize"
        if not any(all(w.lower() in got["refused"].lower() for w in fuzz.refusal_words(p)) for p in pairs):
            return f"refused without naming any of {pairs}: {got['refused']}"
        return None
    if "refused" in got:
        return f"refused at initialize, but no pair of it is declared refused: {got['refused']}"
    at_checkpoint = fuzz.refused_checkpoint_pairs(features)
    if at_checkpoint:
        if "refused_checkpoint" not in got:
            return f"saved and loaded, but {at_checkpoint} must be refused at the checkpoint"
        words = [fuzz.checkpoint_refusal_words(p) for p in at_checkpoint]
        if not any(all(w.lower() in got["refused_checkpoint"].lower() for w in ws) for ws in words):
            return f"checkpoint refused without naming any of {at_checkpoint}: {got['refused_checkpoint']}"
        return None
    if "refused_checkpoint" in got:  # saving half a batch may be refused (not silently)
        refusal = got["refused_checkpoint"]
        return None if "accumulation" in refusal.lower() else f"save or load failed: {refusal}"
    if got["missing"]:
        return f"a feature left no trace: {got['missing']}"
    twin = fuzz.overlap_twin(features)
    if twin is not None:
        said = differs_from_twin(got["params"], twin, results.get(twin, {}))
        if said:
            return said
    reference = results[fuzz.reference_of(features)]
    if "params" not in reference:
        return f"its reference {fuzz.reference_of(features)} did not train: {reference}"
    tol, worst, beyond = fuzz.tolerance(features), (0.0, ""), []
    for name, a in got["params"].items():
        b = reference["params"].get(name)
        if b is None:
            return f"parameter {name} is not in the reference"
        if not a.isfinite().all():  # NaN compares as no difference at all
            return f"parameter {name} is not finite"
        diff = (a - b).abs()
        scale = b.abs().max().clamp_min(fuzz.scale_floor(features))
        worst = max(worst, ((diff.max() / scale).item(), name))
        beyond += [(d, name) for d in diff[diff > tol * scale].tolist()]
    if worst[0] <= tol:
        return None
    said = f"differs from its reference {fuzz.reference_of(features)}: {worst[1]} by {worst[0]:.3g} (tolerance {tol})"
    allowed = fuzz.rounding_decided(features, sum(p.numel() for p in got["params"].values()))
    if allowed is None or not beyond:
        return said
    count, bound = allowed
    largest = max(beyond)
    if len(beyond) <= count and largest[0] <= bound:
        return None  # a few rounding-decided Adam steps (composition_fuzz_model.rounding_decided)
    return (f"{said}; {len(beyond)} elements beyond it (at most {count} may be rounding-decided), the largest "
            f"{largest[1]} by {largest[0]:.3g} (at most {bound:.3g})")


def differs_from_twin(params: dict, twin: tuple[str, ...], other: dict) -> str | None:
    """Why an overlapped offload's parameters are not bit for bit its twin's (the same set with
    ``cpu_offload``: composition.overlap_twin), or ``None``."""
    if "params" not in other:
        return f"the same set with cpu_offload {twin} did not train: {str(other)[:600]}"
    for name, a in params.items():
        b = other["params"][name]
        if not a.equal(b):
            return (f"differs from the same set with cpu_offload {twin}, the step after backward it must equal bit for "
                    f"bit: {name} by {(a - b).abs().max().item():.3g}")
    return None


def shrink(failures: dict[tuple[str, ...], str], root: str) -> dict[tuple[str, ...], tuple[tuple[str, ...], str]]:
    """Each failing set's smallest failing subset, reached by removing one feature at a time while
    the set still fails; every round's candidates of every set run in one process group."""
    current = {drawn: (drawn, why) for drawn, why in failures.items()}
    active = set(current)
    while active:
        candidates = {drawn: [c for c in (tuple(f for f in current[drawn][0] if f != drop)
                                          for drop in current[drawn][0]) if fuzz.drawable(c)]
                      for drawn in active}
        every = list(dict.fromkeys(c for cs in candidates.values() for c in cs))
        results = run(every, root) if every else {}
        verdicts = {c: verdict(c, results) for c in every}
        for drawn in list(active):
            failing = [c for c in candidates[drawn] if verdicts[c]]
            if failing:
                current[drawn] = (failing[0], verdicts[failing[0]])
            else:
                active.discard(drawn)
    return current


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--sets", help="run these sets instead of drawing: a,b,c;d,e,f")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as root:
        sets = ([fuzz.canonical(s.split(",")) for s in args.sets.split(";")] if args.sets
                else draw(args.examples, args.seed))
        results = run(sets, root)
        failures = [(s, verdict(s, results)) for s in sets]
        failures = [(s, why) for s, why in failures if why]
        print(f"{len(sets)} sets run, {len(failures)} failed", flush=True)
        for s, why in failures:
            print(f"  {' x '.join(s)}: {why.strip().splitlines()[-1]}", flush=True)
        minimal: dict[tuple[str, ...], list[Any]] = {}
        smallest = ({s: (s, why) for s, why in failures} if args.no_shrink else shrink(dict(failures), root))
        for drawn, (small, why) in smallest.items():
            minimal.setdefault(small, [why, []])[1].append(drawn)
        for small, (why, drawn) in minimal.items():
            print(f"\nFAIL {' x '.join(small)}  (from {len(drawn)} drawn: {'; '.join(' x '.join(d) for d in drawn)})")
            print("  " + why.strip().replace("\n", "\n  "))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
