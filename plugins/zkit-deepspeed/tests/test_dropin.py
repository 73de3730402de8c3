"""The drop-in distribution: its metadata answers for ``deepspeed``, ``deepspeed.X`` is
``zkit.compat.deepspeed.X`` (the same module objects), and ``zkit report`` says which
``deepspeed`` is active."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from zkit_deepspeed import alias
from zkit_deepspeed import plugin


def test_metadata_answers_for_deepspeed():
    # transformers and accelerate ask for the distribution by name before importing the module
    version = importlib.metadata.version("deepspeed")
    assert version.endswith("+zkit")
    packaging = pytest.importorskip("packaging.version")
    assert packaging.Version(version) >= packaging.Version("0.9.3")
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """A package ``fakeimpl`` (a package, a subpackage, a module) aliased as ``fakealias``."""
    root = tmp_path / "fakeimpl"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("STATE = []\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "leaf.py").write_text("def f():\n    return 'leaf'\n")
    (root / "mod.py").write_text("from fakeimpl.sub import leaf\ndef g():\n    return leaf.f()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)
    yield
    sys.meta_path[:] = before
    for name in [n for n in sys.modules if n.split(".")[0] in ("fakeimpl", "fakealias")]:
        del sys.modules[name]


def test_alias_gives_the_same_module_objects(fake_tree):
    package = alias.install("fakealias", "fakeimpl")
    import fakealias
    import fakealias.sub.leaf
    from fakealias import mod
    from fakealias.sub import leaf

    import fakeimpl

    assert fakealias is package is fakeimpl
    assert leaf is fakealias.sub.leaf is sys.modules["fakeimpl.sub.leaf"]
    assert mod is sys.modules["fakeimpl.mod"] and mod.__name__ == "fakeimpl.mod"
    # a patch through one name is seen through the other, as transformers' patches must be
    leaf.f = lambda: "patched"
    assert importlib.import_module("fakeimpl.mod").g() == "patched"
    # installing twice adds no second finder
    alias.install("fakealias", "fakeimpl")
    assert sum(isinstance(f, alias.AliasFinder) and f.alias == "fakealias" for f in sys.meta_path) == 1


def test_alias_missing_names_are_ordinary_import_errors(fake_tree):
    alias.install("fakealias", "fakeimpl")
    # feature probes must answer None / ImportError, as on a DeepSpeed built without an extension
    assert importlib.util.find_spec("fakealias.absent") is None
    with pytest.raises(ModuleNotFoundError, match="No module named 'fakealias.absent'"):
        importlib.import_module("fakealias.absent")
    with pytest.raises(ModuleNotFoundError, match="'fakealias.mod' is not a package"):
        importlib.import_module("fakealias.mod.inner")
    assert "fakealias.absent" not in sys.modules


def test_alias_without_target_says_what_to_do():
    with pytest.raises(ImportError, match=r"the fakealias2 drop-in needs no_such_pkg_zkit\.compat.*"
                                          r"`pip uninstall fakealias2` to use a real DeepSpeed"):
        alias.install("fakealias2", "no_such_pkg_zkit.compat")


def test_import_deepspeed_is_zkit_compat():
    compat = pytest.importorskip("zkit.compat.deepspeed")
    import deepspeed

    assert deepspeed is compat
    assert importlib.import_module("deepspeed.accelerator") is importlib.import_module(
        "zkit.compat.deepspeed.accelerator")


def test_report_names_the_dropin():
    ((topic, text),) = list(plugin.zkit_report())
    assert topic == "deepspeed"
    assert text.startswith(f"deepspeed {importlib.metadata.version('deepspeed')} is zkit's drop-in")
    assert "pip uninstall deepspeed && pip install deepspeed" in text


def test_report_names_a_real_deepspeed_that_comes_first(tmp_path):
    # a DeepSpeed package earlier on the path than the drop-in is what `import deepspeed` runs
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    code = textwrap.dedent("""
        from zkit_deepspeed import active_deepspeed
        print(active_deepspeed().describe())
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert f"from {tmp_path / 'deepspeed' / '__init__.py'} is not zkit's drop-in" in out.stdout
    assert "`import deepspeed` runs that DeepSpeed, not zkit" in out.stdout
