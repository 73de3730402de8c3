"""The kernel's shape holds: ``zkit/core`` imports no built-in package and no plugin distribution,
has no import circle (function-local imports counted), and nothing outside tests builds the torch
communicator directly; the built-ins that left the engine (monitor, ZeRO's model preparation,
activation checkpointing) are reached through their hooks, so a plugin can replace them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import zkit
from zkit.core.metrics import NoMonitor

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "tools" / "kernel_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_report"] = module
    spec.loader.exec_module(module)
    return module.report(ROOT / "zkit", ROOT)


def test_the_core_imports_nothing_outside_it(report):
    assert report["core_imports_outside_core"] == []


def test_no_plugin_distribution_is_imported_and_no_communicator_built_directly(report):
    assert report["plugin_imports"] == []
    assert report["communicator_constructions"] == []


@pytest.fixture(scope="module")
def imports(report):
    return sys.modules["kernel_report"].import_contract()


def test_built_ins_depend_one_way_through_public_names(imports):
    """No circle between built-in packages, and a built-in reaches another only through the names
    its package ``__init__`` exports (or the core)."""
    assert imports["package_circles"] == []
    assert imports["builtin_private_imports"] == []
    assert imports["builtin_dependencies"]  # the pass sees the built-ins' imports of each other


def test_installed_plugins_import_only_public_names(imports):
    """Installed plugins (plugins/*, cuda_numba/) import a built-in's package or the core, never one
    of its modules: a change inside zkit/zero/flat.py breaks no distribution."""
    assert imports["plugin_private_imports"] == {}


def test_the_contract_pass_finds_a_private_import_and_a_circle(tmp_path):
    """The pass itself: a plugin importing a built-in's module, and two built-ins importing each
    other, are what it reports."""
    kernel_report = sys.modules["kernel_report"]
    for package, text in {"a": "from zkit.b.inner import x\n", "b": "from zkit.a import y\n"}.items():
        (tmp_path / "zkit" / package).mkdir(parents=True)
        (tmp_path / "zkit" / package / "__init__.py").write_text(text)
    (tmp_path / "zkit" / "b" / "inner.py").write_text("x = 1\n")
    (tmp_path / "zkit" / "__init__.py").write_text("")
    (tmp_path / "plug" / "plug").mkdir(parents=True)
    (tmp_path / "plug" / "plug" / "__init__.py").write_text("from zkit.b.inner import x\nfrom zkit.a import y\n")
    original = kernel_report.ROOT
    kernel_report.ROOT = tmp_path
    try:
        found = kernel_report.import_contract({"zkit": (tmp_path / "zkit", tmp_path),
                                               "plug": (tmp_path / "plug" / "plug", tmp_path / "plug")})
    finally:
        kernel_report.ROOT = original
    assert found["package_circles"] == [["a", "b"]]
    assert found["builtin_private_imports"] == ["zkit/a/__init__.py: zkit.b.inner"]
    assert found["plugin_private_imports"] == {"plug": ["plug/plug/__init__.py: zkit.b.inner"]}


def test_the_core_has_no_import_circle_even_counting_function_local_imports(report):
    assert [c for c in report["circles_with_local_imports"] if any(m.startswith("zkit.core") for m in c)] == []
    assert report["circles"] == []


class RecordingMonitor:
    enabled = True

    def __init__(self):
        self.events, self.closed = [], 0

    def write_events(self, events):
        self.events.extend(events)

    def flush(self):
        pass

    def close(self):
        self.closed += 1


class Plugin:
    def __init__(self):
        self.monitor = RecordingMonitor()
        self.prepared = []

    @zkit.hookimpl
    def zkit_make_monitor(self, config, rank):
        return self.monitor

    @zkit.hookimpl
    def zkit_prepare_model(self, model, stage, world_size):
        self.prepared.append((type(model).__name__, stage, world_size))


def _train(stack, steps=2):
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2, "steps_per_print": 1, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zkit.initialize(model=torch.nn.Linear(3, 1), config=cfg, stack=stack)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
    engine.close()
    return engine


def test_a_plugins_monitor_and_model_preparation_are_used():
    plugin = Plugin()
    engine = _train(zkit.Stack(plugins=[plugin]))
    assert engine.monitor is plugin.monitor and plugin.monitor.closed == 1
    assert [step for tag, _, step in plugin.monitor.events if tag == "Train/loss"] == [1, 2]
    assert plugin.prepared == [("Linear", 2, 1)]


def test_without_the_monitor_plugin_the_engine_writes_nothing(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.monitor")
    engine = _train(None, steps=1)
    assert isinstance(engine.monitor, NoMonitor)
    engine.monitor.write_events([("Eval/loss", 1.0, 1)])  # user code may still call it


class PhaseRecorder:
    """A third party's view of the engine's work through the telemetry hooks."""

    def __init__(self):
        self.calls, self.losses = [], []

    def _context(self, what):
        import contextlib

        @contextlib.contextmanager
        def recorded():
            self.calls.append(("enter", what))
            yield
            self.calls.append(("exit", what))

        return recorded()

    @zkit.hookimpl
    def zkit_phase(self, engine, phase):
        return self._context(phase)

    @zkit.hookimpl
    def zkit_model_pass(self, engine, direction):
        return self._context("model " + direction)

    @zkit.hookimpl
    def zkit_after_step(self, engine, losses):
        self.losses.append((engine.global_steps, [tuple(loss.shape) for loss in losses]))


def test_phases_model_passes_and_steps_reach_a_plugin_in_order():
    recorder = PhaseRecorder()
    _train(zkit.Stack(plugins=[recorder]), steps=2)
    one_step = [("enter", "forward"), ("enter", "model forward"), ("exit", "model forward"), ("exit", "forward"),
                ("enter", "backward"), ("enter", "model backward"), ("exit", "model backward"), ("exit", "backward"),
                ("enter", "step"), ("exit", "step")]
    assert recorder.calls == one_step * 2
    # the losses come as device tensors: a plugin reads their values only when it needs them
    assert recorder.losses == [(1, [()]), (2, [()])]


def test_without_the_telemetry_plugin_the_engine_trains_and_logs_no_step_line(monkeypatch, caplog):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.telemetry")
    plugin = Plugin()
    with caplog.at_level("INFO", logger="zkit"):
        engine = _train(zkit.Stack(plugins=[plugin]), steps=2)
    assert engine.global_steps == 2
    assert plugin.monitor.events == [] and "step 2" not in caplog.text
