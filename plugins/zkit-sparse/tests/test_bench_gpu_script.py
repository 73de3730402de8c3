"""``bench_sparse_attention.py --cpu-smoke`` runs the GPU table's code on tiny CPU shapes, so the
``--gpu`` run is not the first time that code executes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "contrib" / "bench" / "bench_sparse_attention.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cpu_smoke_writes_the_table(tmp_path):
    proc = _run("--cpu-smoke", "--out-dir", str(tmp_path), "--layout", "fixed",
                "--stages", "kernels", "gpt")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    kernels = {r["variant"]: r for r in rows if r["stage"] == "kernels"}
    assert set(kernels) == {"dense", "flex", "flex-hand", "flex-again", "torch"}
    for name in ("flex", "flex-hand", "flex-again", "torch"):
        assert "error" not in kernels[name] and kernels[name]["median_s"] > 0
        assert max(kernels[name]["max_abs"].values()) < 2e-2  # bf16 against float64
    gpt = [r for r in rows if r["stage"] == "gpt"]
    assert [(r["variant"], r["seq"]) for r in gpt] == [("dense", 128), ("block_sparse", 128),
                                                       ("dense", 256), ("block_sparse", 256)]
    assert all("median_s" in r for r in gpt)
    table = (tmp_path / "table.md").read_text()
    assert "| kernels | fixed | 128 | bfloat16 | 0.375 | flex |" in table


def test_gpu_mode_needs_a_gpu(tmp_path):
    proc = _run("--gpu", "--out-dir", str(tmp_path))
    assert proc.returncode != 0
    assert "--gpu needs a CUDA device (use --cpu-smoke to check the script here)" in proc.stderr
