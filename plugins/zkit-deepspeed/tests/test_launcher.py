"""The drop-in's ``deepspeed`` command: DeepSpeed's launcher flags on one node, run by ``zkit run``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepspeed.launcher import runner

SCRIPT = textwrap.dedent("""
    import argparse, os, sys
    import torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    import helper  # a module next to the script: the script's folder comes first on sys.path
    print(f"rank={os.environ['RANK']} local_rank={args.local_rank} steps={args.steps} "
          f"world={dist.get_world_size()} helper={helper.NAME}", flush=True)
    dist.barrier()  # a rank that exits at once closes its gloo pairs under a peer still connecting them
""")


def _write(tmp_path: Path) -> Path:
    (tmp_path / "helper.py").write_text("NAME = 'mine'\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return script


def test_command_line():
    cmd, env = runner.command(["--num_gpus", "2", "--master_port", "29611", "train.py", "--steps", "3"])
    assert cmd[1:6] == ["-m", "zkit.cli", "run", "--nproc", "2"] and cmd[6:8] == ["--master-port", "29611"]
    assert cmd[-3:] == ["train.py", "--steps", "3"] and cmd[-4].endswith("user_script.py")
    assert env == {"ZKIT_DEEPSPEED_LOCAL_RANK_ARG": "1", "ZKIT_DEEPSPEED_MODULE": "0"}
    _, env = runner.command(["--no_local_rank", "--module", "pkg.train"])
    assert env == {"ZKIT_DEEPSPEED_LOCAL_RANK_ARG": "0", "ZKIT_DEEPSPEED_MODULE": "1"}


@pytest.mark.parametrize("argv, message", [
    (["--num_nodes", "2"], "--num_nodes: the deepspeed drop-in launches one node; for several nodes run "
                           "`zkit run --nnodes N"),
    (["--hostfile", "hosts.txt"], "--hostfile: the deepspeed drop-in launches one node"),
    (["--force_multi"], "--force_multi: the deepspeed drop-in launches one node"),
    (["--include", "worker-1:0,1"], "--include 'worker-1:0,1': only 'localhost:0,1,...' (this node's devices)"),
    (["--include", "localhost:a"], "--include 'localhost:a': device numbers must be integers"),
    (["--autotuning", "run"], "--autotuning is not supported: DeepSpeed's autotuner is not part of zkit"),
    (["--bind_cores_to_rank"], "--bind_cores_to_rank is not supported: use `zkit run --threads-per-rank N`"),
    (["--no_python"], "--no_python is not supported: zkit run starts Python scripts and modules only"),
])
def test_refused_flags_say_what_to_use(argv, message):
    with pytest.raises(SystemExit, match=r"^deepspeed \(zkit drop-in\): " + _escape(message)):
        runner.command([*argv, "train.py"])


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _launch(argv: list[str], cwd: Path) -> str:
    launcher = Path(sys.executable).with_name("deepspeed")
    if not launcher.exists():
        pytest.skip(f"the drop-in's deepspeed command is not installed next to {sys.executable}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(launcher), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_two_ranks_get_local_rank_like_deepspeeds_launcher(tmp_path):
    script = _write(tmp_path)
    out = _launch(["--num_gpus", "2", str(script), "--steps", "3"], cwd=tmp_path)
    for rank in (0, 1):
        assert f"rank={rank} local_rank={rank} steps=3 world=2 helper=mine" in out


def test_module_without_local_rank(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(_write(tmp_path), package / "train.py")
    shutil.copy(tmp_path / "helper.py", package / "helper.py")
    (package / "train.py").write_text(SCRIPT.replace("import helper", "from pkg import helper"))
    out = _launch(["--num_gpus", "2", "--no_local_rank", "--module", "pkg.train", "--steps", "1"], cwd=tmp_path)
    for rank in (0, 1):
        assert f"rank={rank} local_rank=None steps=1 world=2 helper=mine" in out
