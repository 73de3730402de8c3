"""A third-party distribution (contrib/plugin-example) is discovered, selected by name, blocked,
and reported, exactly as an installed plugin would be."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRAIN = """
import torch, zkit
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
cfg = {"train_batch_size": 4, "steps_per_print": 100,
       "optimizer": {"type": "Signum", "params": {"lr": 0.01, "momentum": 0.5}}}
engine, opt, *_ = zkit.initialize(model=model, config=cfg)
x, y = torch.randn(4, 4), torch.randn(4, 1)
losses = []
for _ in range(20):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss); engine.step(); losses.append(loss.item())
print(type(opt).__name__, losses[-1] < losses[0])
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "contrib" / "plugin-example")],
        check=True,
    )
    return target


def _run(site, args, **env):
    full_env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=300)


def test_discovered_and_listed(site):
    out = _run(site, ["-m", "zkit.cli", "plugins"])
    assert out.returncode == 0, out.stderr
    assert "example" in out.stdout
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("signum"))
    assert "zkit-example-plugin 0.1.0" in line


def test_selected_by_name_from_the_config(site):
    out = _run(site, ["-c", TRAIN])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["Signum", "True"]


def test_blocked_on_the_command_line_and_by_environment(site):
    out = _run(site, ["-m", "zkit.cli", "-p", "no:example", "plugins"])
    assert "signum" not in out.stdout
    out = _run(site, ["-c", TRAIN], ZKIT_BLOCK_PLUGINS="zkit-example-plugin")
    assert out.returncode != 0
    assert "unknown optimizer 'Signum'" in out.stderr


def test_reported(site):
    out = _run(site, ["-m", "zkit.cli", "report"])
    assert out.returncode == 0, out.stderr
    assert "zkit-example-plugin: Signum optimizer registered" in out.stdout
