"""Hooks receive what they need rather than the whole engine: the few that still get the
``Engine`` say why in their manual (the docstring in ``zkit/core/hookspecs.py``), and no other
hook takes it."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

from zkit.core import hookspecs

ROOT = Path(__file__).resolve().parent.parent

#: the hooks that get the whole engine, and what their manual says is why
WHOLE_ENGINE = {
    "zkit_engine_setup": "attaches to the engine",
    "zkit_engine_close": "releases here what it attached",
    "zkit_train_batch": "drives it as a training loop does",
    "zkit_eval_batch": "drives the engine's forward",
    "zkit_phase": "reports on it",
    "zkit_model_pass": "reports on it",
    "zkit_after_step": "a report reads",
    "zkit_checkpoint_save": "where it attached",
    "zkit_checkpoint_load": "for the reason",
    "zkit_checkpoint_format": "saves or fills all of it",
    "zkit_save_16bit_model": "gathering the model's state",
    "zkit_consolidated_16bit_state_dict": "for the reason",
}


def _kernel_report():
    spec = importlib.util.spec_from_file_location("kernel_report_for_hooks", ROOT / "tools" / "kernel_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_only_the_hooks_that_say_why_take_the_whole_engine():
    taking = _kernel_report().hooks_taking_engine(ROOT / "zkit" / "core" / "hookspecs.py")
    assert set(taking) == set(WHOLE_ENGINE)
    for name, why in WHOLE_ENGINE.items():
        doc = " ".join(inspect.getdoc(getattr(hookspecs, name)).split())
        assert "gets the whole engine" in doc and why in doc, name


def test_the_narrowed_hooks_name_no_engine_argument():
    for name in ("zkit_optimizer_step", "zkit_grad_norm", "zkit_before_backward", "zkit_after_backward",
                 "zkit_client_optimizer", "zkit_client_lr_scheduler", "zkit_make_monitor", "zkit_sequence_parallel"):
        assert "engine" not in inspect.signature(getattr(hookspecs, name)).parameters, name
