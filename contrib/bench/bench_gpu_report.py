"""``bench_gpu.py``'s output: the machine it ran on, the table (markdown on stdout and in
``bench_gpu.md``, ``bench_gpu.csv``), a bar chart (``bench_gpu.png``, with matplotlib) and what
``torch.compile`` gained per contestant."""
from __future__ import annotations

import csv
import os
import platform
import statistics
import subprocess
from typing import Any

from bench_gpu_bound import bound_of

GIB = 2**30
COLUMNS = ["contestant", "step ms", "x torch", "model TFLOP/s", "peak device GiB", "peak RSS GiB", "bound ms",
           "x bound", "compute / transfers / host opt ms", "device busy", "zkit ranges (count, host ms)", "note"]


def describe_machine(cpu_only: bool) -> str:
    import torch

    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU threads"
    if cpu_only or not torch.cuda.is_available():
        return f"CPU only ({cpu}), torch {torch.__version__}"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown (no nvidia-smi)"
    return (f"{torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"{cpu}")


def _median(r: dict[str, Any]) -> float | None:
    return statistics.median(r["times"]) if "times" in r else None


def rows(results: dict[str, dict[str, Any]], bound: dict[str, Any] | None, shape: Any,
         tokens: int) -> list[dict[str, str]]:
    base = _median(results.get("torch", {}))
    out = []
    for name, r in results.items():
        row = dict.fromkeys(COLUMNS, "-")
        row["contestant"] = name
        t = _median(r)
        if t is None:
            row["note"] = r.get("error", "no result")
            out.append(row)
            continue
        row["step ms"] = f"{1e3 * t:.1f}"
        row["x torch"] = f"{t / base:.2f}" if base else "-"
        row["model TFLOP/s"] = f"{shape.step_flops(tokens) / t / 1e12:.3g}"
        if "peak_device" in r:
            row["peak device GiB"] = f"{r['peak_device'] / GIB:.2f}"
        row["peak RSS GiB"] = f"{r['peak_rss'] / GIB:.2f}"
        b = bound_of(name, bound) if bound and "error" not in bound else None
        if b is not None:
            row["bound ms"] = f"{1e3 * b['bound_s']:.1f}"
            row["x bound"] = f"{t / b['bound_s']:.2f}"
            row["compute / transfers / host opt ms"] = " / ".join(
                f"{1e3 * b[k]:.1f}" for k in ("compute_s", "transfer_s", "host_opt_s"))
        if "device_busy_s" in r:
            row["device busy"] = f"{r['device_busy_s'] / r['traced_step_s']:.0%} (gap {1e3 * r['largest_gap_s']:.2f} ms)"
        if r.get("ranges"):
            row["zkit ranges (count, host ms)"] = ", ".join(
                f"{k} {int(n)}, {1e3 * s:.1f}" for k, (n, s) in sorted(r["ranges"].items()))
        row["note"] = f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
        out.append(row)
    return out


def compile_gains(results: dict[str, dict[str, Any]]) -> list[str]:
    """Per compiled contestant: its speed-up from torch.compile, and the share it keeps of plain PyTorch's."""
    torch_gain = None
    if _median(results.get("torch", {})) and _median(results.get("torch-compile", {})):
        torch_gain = _median(results["torch"]) / _median(results["torch-compile"])
    lines = []
    for name, r in results.items():
        eager = results.get(name.removesuffix("-compile"), {})
        if not name.endswith("-compile") or not _median(r) or not _median(eager):
            continue
        gain = _median(eager) / _median(r)
        kept = f", {gain / torch_gain:.2f} of plain PyTorch's" if torch_gain and name != "torch-compile" else ""
        lines.append(f"- {name}: torch.compile speed-up {gain:.2f}x{kept}")
    return lines


def report(results: dict[str, dict[str, Any]], bound: dict[str, Any] | None, args: Any, shape: Any,
           machine: str) -> None:
    tokens = args.micro_batch * args.seq
    table = rows(results, bound, shape, tokens)
    lines = [f"{machine}", "",
             f"GPT {shape.parameters() / 1e6:.1f}M parameters ({shape.layers} x {shape.width}, vocabulary {shape.vocab}), "
             f"micro-batch {args.micro_batch} x {args.seq}, {args.dtype}, AdamW, one process each; median of "
             f"{args.steps} steps after {args.warmup}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in table]
    if bound and "error" in bound:
        lines += ["", f"bound not measured: {bound['error']}"]
    gains = compile_gains(results)
    if gains:
        lines += ["", *gains]
    text = "\n".join(lines)
    print(text)
    if not args.out:
        return
    with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_gpu.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    print(plot(table, os.path.join(args.out, "bench_gpu.png"), machine))


def plot(table: list[dict[str, str]], path: str, title: str) -> str:
    """Step time against plain PyTorch's, one bar per contestant; says what it wrote, or why nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: matplotlib is not installed, no PNG"
    done = [r for r in table if r["x torch"] != "-"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(done)), 4))
    ax.bar([r["contestant"] for r in done], [float(r["x torch"]) for r in done])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("step time / plain PyTorch's")
    ax.set_title(title, fontsize=8)
    ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
