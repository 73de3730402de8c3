"""A third-party distribution (contrib/plugin-example) is discovered, selected by name, blocked,
and reported, exactly as an installed plugin would be; its config section is validated like the
kernel's and its gradient-norm wrapper records what the engine computes."""
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
    assert "zkit-example-plugin 0.2.0" in line


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
    assert "zkit-example-plugin: Signum optimizer registered; grad_norm_watch section" in out.stdout


WATCH = """
import json, sys, warnings
import torch, zkit
from zkit.core.config.errors import ConfigError
from zkit_example_plugin import grad_norms

def engine(watch, clip=0.0):
    torch.manual_seed(0)
    cfg = {"train_batch_size": 4, "steps_per_print": 100, "gradient_clipping": clip,
           "optimizer": {"type": "Signum", "params": {"lr": 0.01}}, "grad_norm_watch": watch}
    return zkit.initialize(model=torch.nn.Linear(4, 1), config=cfg)[0]

out = {"errors": []}
for bad in ({"evry": 2}, {"every": 0}, {"warn_above": -1.0}, {"every": "2"}):
    try:
        engine(bad)
        out["errors"].append(None)
    except ConfigError as exc:
        out["errors"].append(str(exc))
for clip in (0.0, 0.01):
    e = engine({"every": 2, "warn_above": 1e-3}, clip)
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    engine_norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            e.backward(torch.nn.functional.mse_loss(e(x), y)); e.step()
            engine_norms.append(e.get_global_grad_norm())
    out[str(clip)] = {"recorded": grad_norms(e), "engine": engine_norms, "warned": [str(w.message) for w in caught]}
print(json.dumps(out))
"""


def test_config_section_and_grad_norm_wrapper(site):
    import json

    out = _run(site, ["-c", WATCH])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    unknown, too_small, not_positive, not_int = result["errors"]
    assert unknown == "unknown config key 'grad_norm_watch.evry'; did you mean 'grad_norm_watch.every'?"
    assert too_small == "config key 'grad_norm_watch.every' must be >= 1, got 0"
    assert not_positive == "config key 'grad_norm_watch.warn_above' must be > 0, got -1.0"
    assert not_int == "config key 'grad_norm_watch.every' must be an int, got '2'"
    for clip in ("0.0", "0.01"):  # with clipping the engine needs the norm anyway: the same record
        run = result[clip]
        steps = [step for step, _ in run["recorded"]]
        assert steps == [2, 4]
        assert [norm for _, norm in run["recorded"]] == pytest.approx([run["engine"][1], run["engine"][3]], rel=1e-6)
        assert all(norm > 0 for norm in run["engine"])
        assert len(run["warned"]) == 2 and "step 2: gradient norm" in run["warned"][0]
        assert "above grad_norm_watch.warn_above=0.001" in run["warned"][0]
