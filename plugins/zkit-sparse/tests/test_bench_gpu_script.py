"""``bench_sparse_attention.py --cpu-smoke`` runs the GPU table's code on tiny CPU shapes, so the
``--gpu`` run is not the first time that code executes; its bookkeeping (first call apart from
the timing, where block-sparse overtakes dense, rows for what ran out of memory) is checked on
synthetic inputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[3] / "contrib" / "bench"
SCRIPT = BENCH / "bench_sparse_attention.py"


@pytest.fixture(scope="module")
def gpu_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import sparse_attention_gpu
        yield sparse_attention_gpu
    finally:
        sys.path.remove(str(BENCH))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cpu_smoke_writes_the_table(tmp_path):
    proc = _run("--cpu-smoke", "--out-dir", str(tmp_path), "--families", "fixed", "bslongformer",
                "--seq", "128", "512", "--stages", "kernels", "gpt")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    kernels = [r for r in rows if r["stage"] == "kernels"]
    # most wanted first: the 12x case, the long bslongformer case at layout block 128, then the rest
    order = list(dict.fromkeys((r["layout"], r["block"], r["seq"]) for r in kernels))
    assert order == [("fixed", 64, 128), ("bslongformer", 128, 512), ("fixed", 128, 128),
                     ("bslongformer", 128, 128), ("bslongformer", 64, 128), ("fixed", 128, 512),
                     ("fixed", 64, 512), ("bslongformer", 64, 512)]
    first = {r["variant"]: r for r in kernels if (r["layout"], r["block"], r["seq"]) == order[0]}
    assert set(first) == {"dense-causal", "dense-bidir", "flex", "flex-hand", "flex-again", "torch"}
    for r in kernels:
        assert "error" not in r and r["median_s"] > 0, r
        if not r["variant"].startswith("dense"):
            assert max(r["max_abs"].values()) < 2e-2  # bf16 against float64
    # layout blocks of the tile's size (32 here, 128 on the GPU): full tiles only, no mask_mod
    assert all(r["tiles"]["partial"] == 0 for r in kernels if r["layout"] == "bslongformer" and r["block"] == 128)
    gpt = [r for r in rows if r["stage"] == "gpt"]
    assert [(r["variant"], r["seq"]) for r in gpt] == [
        (v, s) for s in (128, 256) for v in ("dense", "fixed-64", "bslongformer-128")]
    assert all("median_s" in r for r in gpt)
    table = (tmp_path / "table.md").read_text()
    assert "| kernels | fixed | 64 | 128 | bfloat16 | 0.375 | 0.375 / 0.125 | flex |" in table
    assert "| x dense SDPA | x flex-hand |" in table and "| block-sparse faster from |" in table


def test_unknown_layout_and_gpu_mode_without_a_gpu_are_refused(tmp_path):
    proc = _run("--cpu-smoke", "--out-dir", str(tmp_path), "--families", "fixed", "dilated")
    assert proc.returncode != 0
    assert "unknown layouts ['dilated']; the table's are ['bigbird', 'bigbird-wide', " in proc.stderr
    proc = _run("--gpu", "--out-dir", str(tmp_path))
    assert proc.returncode != 0
    assert "--gpu needs a CUDA device (use --cpu-smoke to check the script here)" in proc.stderr


def test_first_call_is_reported_apart_from_the_timed_calls(gpu_bench, monkeypatch, tmp_path):
    clock = [0.0]
    calls = []

    def fn():  # the first call "compiles" for 100 s, later ones take 1 s
        calls.append(1)
        clock[0] += 100.0 if len(calls) == 1 else 1.0

    monkeypatch.setattr(gpu_bench.time, "perf_counter", lambda: clock[0])
    run = gpu_bench.Run(tmp_path, smoke=True, budget_s=60, reps=3)
    first, median, reps = gpu_bench.time_call(run, fn, backward=False)
    assert (first, median, reps) == (100.0, 1.0, 3)
    assert len(calls) == 1 + 2 + 3  # first, warm-up, timed


def test_crossover_names_the_shortest_length_where_block_sparse_wins(gpu_bench, tmp_path):
    run = gpu_bench.Run(tmp_path, smoke=True, budget_s=60, reps=3)
    for seq, dense, flex in ((4096, 1.0, 3.0), (16384, 4.0, 4.4), (65536, 64.0, 8.0)):
        for variant, t in (("dense-bidir", dense), ("flex", flex), ("dense-causal", dense / 2)):
            run.rows.append(dict(stage="kernels", layout="bigbird", block=128, seq=seq,
                                 causal=False, variant=variant, backward=True, median_s=t))
    run.rows.append(dict(stage="kernels", layout="fixed", block=64, seq=4096, causal=True,
                         variant="flex", backward=False, median_s=0.1))  # forward only: not compared
    text = gpu_bench.crossover(run)
    assert "| bigbird | 128 | 3.00 | 1.10 | 0.12 | 65536 |" in text
    assert "| fixed |" not in text


def test_gpt_rows_after_running_out_of_memory_say_so(gpu_bench, monkeypatch, tmp_path):
    import zkit.models.gpt as gpt_module

    building = []  # the attention of the model being built, as gpt_stage configures it
    real_config = gpt_module.GPTConfig

    def config(**kw):
        building.append(kw["attention"])
        return real_config(**kw)

    def time_call(run, step, backward, **kw):
        if building[-1] == "dense":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 1.0, 0.5, 2

    monkeypatch.setattr(gpt_module, "GPTConfig", config)
    monkeypatch.setattr(gpu_bench, "time_call", time_call)
    run = gpu_bench.Run(tmp_path, smoke=True, budget_s=600, reps=3)
    gpu_bench.gpt_stage(run, step_cap_s=10.0)
    got = [(r["variant"], r["seq"], r.get("error") or r.get("skipped") or r.get("median_s")) for r in run.rows]
    assert got == [("dense", 128, "out of memory"), ("fixed-64", 128, 0.5), ("bslongformer-128", 128, 0.5),
                   ("dense", 256, "not run after out of memory at 128"), ("fixed-64", 256, 0.5),
                   ("bslongformer-128", 256, 0.5)]
    assert "| dense | 256 | - | - | not run after out of memory at 128 |" in gpu_bench.table(run)
