"""On a CUDA device: ``engine.compile()`` with inductor (the default backend) trains stages 0-2
with the eager run's losses, also with every block checkpointed (one graph, no break), and ``contrib/bench/bench_gpu.py`` runs every contestant on a small
model with traces (the check to run before the full benchmark). Skipped with a reason without CUDA."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

import zkit
from zkit.activations.recompute import apply as checkpoint_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "contrib", "bench")
sys.path.insert(0, BENCH)

from bench_gpu_model import PlainGPT, Shape  # noqa: E402

SHAPE = Shape(layers=2, width=128, heads=4, vocab=1024, seq=128)


def _train(stage: int, compiled: bool, checkpointed: bool = False) -> list[float]:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    model = PlainGPT(SHAPE)
    if checkpointed:
        assert checkpoint_blocks(model, "every") == [f"blocks.{i}" for i in range(SHAPE.layers)]
    engine, *_ = zkit.initialize(model=model, config=cfg)
    if compiled:
        engine.compile()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq), generator=g).cuda()
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    torch._dynamo.reset()
    return losses


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_inductor_trains_stages_0_to_2_as_eager(stage):
    assert _train(stage, True) == pytest.approx(_train(stage, False), rel=1e-4)


def test_inductor_compiles_checkpointed_blocks_into_the_graph_with_eager_losses():
    eager = _train(2, False, checkpointed=True)
    torch._dynamo.utils.counters.clear()
    assert _train(2, True, checkpointed=True) == pytest.approx(eager, rel=1e-4)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_the_gpu_benchmark_runs_every_contestant_on_a_small_model(tmp_path):
    cmd = [sys.executable, os.path.join(BENCH, "bench_gpu.py"), "--compile", "--trace", "--out", str(tmp_path),
           "--layers", "2", "--width", "256", "--heads", "4", "--vocab", "1024", "--seq", "256", "--micro-batch", "2",
           "--warmup", "2", "--steps", "3", "--nvme-dir", str(tmp_path / "nvme")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "bench_gpu.csv") as f:
        rows = {r["contestant"]: r for r in csv.DictReader(f)}
    for name, row in rows.items():
        assert row["note"].startswith("loss "), (name, row["note"])
        assert row["peak device GiB"] != "-" and row["device busy"] != "-", name
    for name in ("zkit-2-offload", "zkit-3-offload"):
        assert float(rows[name]["compute / transfers / host opt ms"].split(" / ")[1]) > 0
    assert "driver" in proc.stdout and "CUDA" in proc.stdout
