"""Plots of the scale benchmarks: step time and peak memory against model size, one line per
contestant. matplotlib is optional (``pip install matplotlib``, or zkit's ``bench`` extra): without
it :func:`plot_sizes` writes nothing and says so."""
from __future__ import annotations

from typing import NamedTuple

GIB = 2**30


class Series(NamedTuple):
    """One contestant: ``(parameters, step seconds, peak memory bytes)`` per size that trained, and
    the parameters of the first size that failed (None: none failed, or none was tried)."""

    name: str
    points: list[tuple[int, float, int]]
    failed_at: int | None = None


def plot_sizes(series: list[Series], cap_bytes: int, path: str, title: str, memory_label: str,
               marks: dict[str, int] | None = None) -> str:
    """Two panels to ``path`` (PNG): step time, and peak memory under the cap (a failed size is a
    cross on the cap line); ``marks`` (label -> parameters) are dotted vertical lines, such as the
    size an estimate predicts. Returns a line saying what was written, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    cap = cap_bytes / GIB
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in series:
        xs = [p / 1e6 for p, _, _ in s.points]
        line, = ax_t.plot(xs, [t for _, t, _ in s.points], marker="o", label=s.name)
        ax_m.plot(xs, [m / GIB for _, _, m in s.points], marker="o", color=line.get_color(), label=s.name)
        if s.failed_at is not None:
            ax_m.plot([s.failed_at / 1e6], [cap], marker="x", markersize=10, color=line.get_color(), linestyle="none")
    for label, params in (marks or {}).items():
        for ax in (ax_t, ax_m):
            ax.axvline(params / 1e6, linestyle=":", color="grey")
        ax_m.annotate(label, (params / 1e6, cap * 0.05), rotation=90, fontsize=7, color="grey", ha="right")
    ax_m.axhline(cap, color="black", linewidth=0.8)
    ax_m.annotate("cap", (0.01, cap), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    ax_t.set(xlabel="parameters (M)", ylabel="step time (s)", title=f"step time, {title}")
    ax_m.set(xlabel="parameters (M)", ylabel=memory_label, title="memory (x: the first size that failed)")
    ax_m.set_ylim(0, cap * 1.1)
    sizes = [p for s in series for p, _, _ in s.points] + [s.failed_at for s in series if s.failed_at]
    if sizes and max(sizes) > 20 * min(sizes):  # a search that doubled its way up
        for ax in (ax_t, ax_m):
            ax.set_xscale("log")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
