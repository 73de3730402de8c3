"""Bubble of every pipeline schedule against theory: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for
interleaved 1F1B, and ZB-H1 below 1F1B; plus the peak number of micro-batches whose activations
each stage holds (GPipe: m; 1F1B: p - s).

The streams are executed by the simulator with unit costs (forward 1, backward 2, split backward
1 + 1; interleaved chunks cost 1/v of that), which is the schedule's own bubble, free of noise.

    python contrib/bench/bench_pipeline_bubble.py

The same bubble measured on real ranks, and the activation memory, are in
``bench_pipeline_measured.py``.
"""
from __future__ import annotations

from zkit_pipeline.schedules import BUILTIN_SCHEDULES
from zkit_pipeline.simulate import DEFAULT_COSTS, simulate


def main() -> None:
    print(f"{'schedule':18} {'p':>2} {'m':>3} {'v':>2} {'bubble':>8} {'theory':>8} {'rel.err':>8}  peak in flight")
    for p in (2, 4):
        for m in (4, 8, 16, 32):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
                kw = {"virtual_stages": v} if name == "interleaved_1f1b" else {}
                streams = [list(BUILTIN_SCHEDULES[name](p, s, m, **kw)) for s in range(p)]
                costs = {k: c / v for k, c in DEFAULT_COSTS.items()}
                r = simulate(streams, m, v, costs=costs)
                theory = (p - 1) / (v * m)
                err = (r.bubble_ratio - theory) / theory
                print(f"{name:18} {p:>2} {m:>3} {v:>2} {r.bubble_ratio:8.4f} {theory:8.4f} {err:+8.1%}  {r.peak_in_flight}")


if __name__ == "__main__":
    main()
