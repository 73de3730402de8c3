"""``contrib/bench/bench_gpu.py --cpu-smoke``: one contestant of each kind of the one-GPU benchmark
(plain PyTorch, zkit stage 3, ZeRO-Offload, stage 3 with parameters on the host, compiled ones)
trains a tiny model in its own process, and the outputs are there: the table, the CSV, a trace per
contestant, the bound of each offloaded step. ``bench_gpu.py --cpu-smoke --compile`` runs them all
(a few minutes on 2 cores)."""
import csv
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "contrib", "bench")
sys.path.insert(0, BENCH)

import bench_gpu  # noqa: E402
from background import Command  # noqa: E402
from bench_gpu_contestants import ALL, COMPILED  # noqa: E402

#: one of each kind, so that the suite stays short (the smoke mode adds the compiled ones)
SMOKE = ("torch", "zkit-2", "zkit-3", "zkit-2-offload", "zkit-3-offload")


def _smoke_command(out) -> list[Command]:
    return [Command([sys.executable, os.path.join(BENCH, "bench_gpu.py"), "--cpu-smoke", "--trace", "--out", str(out),
                     "--contestants", ",".join(SMOKE), "--nvme-dir", str(out / "nvme")])]


#: run beside the other tests from the session's start (tests/background.py)
BACKGROUND = {"smoke": _smoke_command}


@pytest.fixture(scope="module")
def smoke(background, request):
    out, (proc,) = background.wait(request)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "bench_gpu.csv") as f:
        rows = {r["contestant"]: r for r in csv.DictReader(f)}
    return out, proc.stdout, rows


def test_every_contestant_trains_in_the_smoke_run(smoke):
    out, stdout, rows = smoke
    assert set(SMOKE) <= set(ALL)
    assert list(rows) == [*SMOKE, *COMPILED]
    for name, row in rows.items():
        assert row["step ms"] != "-", (name, row["note"])
        assert row["note"].startswith("loss "), (name, row["note"])
        assert os.path.exists(out / f"trace_{name}.json")
    assert "CPU only" in stdout and "torch 2." in stdout
    assert (out / "bench_gpu.md").read_text().strip() == stdout.split("\nplot:")[0].strip()


def test_offloaded_steps_have_their_bound_and_stage_3_traces_name_its_hooks(smoke):
    _, stdout, rows = smoke
    for name in ("zkit-2-offload", "zkit-3-offload"):
        compute, transfers, host_opt = (float(x) for x in rows[name]["compute / transfers / host opt ms"].split(" / "))
        assert float(rows[name]["bound ms"]) == pytest.approx(max(compute, transfers, host_opt), abs=0.1)
        assert transfers == 0  # nothing crosses on a CPU
    assert "gather" in rows["zkit-3"]["zkit ranges (count, host ms)"]
    assert "release" in rows["zkit-3"]["zkit ranges (count, host ms)"]
    assert "- zkit-2-compile: torch.compile speed-up" in stdout


def test_unknown_contestants_are_named(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.parse(["--contestants", "torch,zkit-4,zkit-3-compile"])
    assert "unknown contestants zkit-3-compile, zkit-4; choose from torch, fsdp2" in capsys.readouterr().err
