"""The coverage inventory: every provided name resolves, every refused one raises its message,
probes of refused modules answer "absent", and docs/deepspeed-coverage.md is the generator's output."""
from __future__ import annotations

import importlib
import importlib.util
import io
from pathlib import Path

import pytest

import deepspeed  # noqa: F401 - the drop-in's alias
from deepspeed.refused import REFUSED_MODULES, REFUSED_NAMES, FeatureNotProvided, refusal_for
from zkit_deepspeed.coverage import ENTRIES, SOURCES, Status, resolve
from zkit_deepspeed.coverage_page import write

PAGE = Path(__file__).resolve().parents[3] / "docs" / "deepspeed-coverage.md"


def test_page_is_up_to_date():
    out = io.StringIO()
    write(out)
    assert PAGE.read_text(encoding="utf-8") == out.getvalue(), (
        "docs/deepspeed-coverage.md is stale: run python -m zkit_deepspeed.coverage_page > docs/deepspeed-coverage.md"
    )


def test_entries_are_unique_sorted_and_sourced():
    names = [e.name for e in ENTRIES]
    assert names == sorted(set(names))
    assert all(e.sources and set(e.sources) <= set(SOURCES) for e in ENTRIES)


def test_every_provided_name_resolves():
    failures = {}
    for e in ENTRIES:
        if e.status is Status.PROVIDED:
            try:
                resolve(e.name)
            except Exception as exc:  # noqa: BLE001 - report them all
                failures[e.name] = f"{type(exc).__name__}: {exc}"
    assert not failures, failures


def test_every_refused_name_raises_its_message():
    wrong = {}
    for e in ENTRIES:
        if e.status is not Status.REFUSED:
            continue
        refusal = refusal_for(e.name)
        try:
            resolve(e.name)
            wrong[e.name] = "resolved"
        except FeatureNotProvided as exc:
            parent = next(m for m in [e.name] + [e.name.rsplit(".", i)[0] for i in range(1, e.name.count("."))]
                          if m in REFUSED_NAMES or m in REFUSED_MODULES)
            if refusal is None or str(exc) != refusal.message(parent):
                wrong[e.name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - report them all
            wrong[e.name] = f"{type(exc).__name__}: {exc}"
    assert not wrong, wrong


def test_refusals_name_the_feature_and_what_to_use():
    for table in (REFUSED_MODULES, REFUSED_NAMES):
        for name, refusal in table.items():
            assert refusal.feature and refusal.instead, name
            assert refusal.message(name).startswith(f"{name} ({refusal.feature}) is not provided by zkit: ")


def test_pending_names_resolve_or_are_absent():
    for e in ENTRIES:
        if e.status is Status.PENDING:
            try:
                resolve(e.name)
            except (ModuleNotFoundError, AttributeError):
                pass


def test_a_refused_module_is_absent_to_probes_and_explains_itself_on_import():
    assert importlib.util.find_spec("deepspeed.inference") is None
    assert importlib.util.find_spec("deepspeed.ops.transformer") is None
    with pytest.raises(FeatureNotProvided, match=r"deepspeed.inference \(DeepSpeed-Inference.*\) is not provided "
                                                 r"by zkit: evaluate with an engine"):
        import deepspeed.inference  # noqa: F401
    try:  # the probe libraries write
        import deepspeed.ops.transformer  # noqa: F401
        present = True
    except ImportError:
        present = False
    assert not present
    # names zkit neither provides nor refuses keep Python's own errors
    assert importlib.util.find_spec("deepspeed.no_such_module") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.no_such_module")
    assert not hasattr(importlib.import_module("deepspeed"), "no_such_name")


def test_a_refused_attribute_raises_on_from_import_and_on_access():
    with pytest.raises(FeatureNotProvided, match="MiCS"):
        from deepspeed.zero import MiCS_Init  # noqa: F401
    with pytest.raises(FeatureNotProvided, match="DeepSpeed's compiled CUDA/C\\+\\+ transformer kernels"):
        importlib.import_module("deepspeed").DeepSpeedTransformerLayer
