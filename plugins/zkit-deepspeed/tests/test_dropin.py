"""The drop-in distribution: its metadata answers for ``deepspeed``, ``deepspeed.X`` is its own
module (refused ones raise, optional plugins are named when missing), and ``zkit report`` says
which ``deepspeed`` is active."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepspeed.refused import FeatureNotProvided
from zkit_deepspeed import plugin, refusing_finder
from zkit_deepspeed.active import dropin_init
from zkit_deepspeed.optional import MissingPlugin


def test_metadata_answers_for_deepspeed():
    # transformers and accelerate ask for the distribution by name before importing the module
    version = importlib.metadata.version("deepspeed")
    assert version.endswith("+zkit")
    packaging = pytest.importorskip("packaging.version")
    assert packaging.Version(version) >= packaging.Version("0.9.3")
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"


def test_deepspeed_is_the_distributions_own_package():
    import deepspeed
    import deepspeed.runtime.zero.partition_parameters as pp

    # one module object per name: transformers' patch of a deepspeed function is what zkit's code sees
    assert deepspeed.__file__ == str(dropin_init())
    assert sys.modules["deepspeed.runtime.zero.partition_parameters"] is pp
    assert deepspeed.zero.Init is pp.Init
    assert not any(name.startswith("zkit.compat") for name in sys.modules)


def test_missing_names_are_ordinary_import_errors():
    import deepspeed  # noqa: F401

    # feature probes must answer None / ImportError, as on a DeepSpeed built without an extension
    assert importlib.util.find_spec("deepspeed.absent") is None
    with pytest.raises(ModuleNotFoundError, match="No module named 'deepspeed.absent'"):
        importlib.import_module("deepspeed.absent")
    with pytest.raises(ModuleNotFoundError, match="'deepspeed.constants' is not a package"):
        importlib.import_module("deepspeed.constants.inner")
    assert "deepspeed.absent" not in sys.modules


def test_refused_module_raises_on_import_and_is_absent_to_probes():
    import deepspeed  # noqa: F401

    assert importlib.util.find_spec("deepspeed.inference") is None
    with pytest.raises(FeatureNotProvided, match=r"deepspeed\.inference \(DeepSpeed-Inference.*\) is not provided by zkit"):
        importlib.import_module("deepspeed.inference")
    # installing twice adds no second finder
    refusing_finder.install()
    assert sum(isinstance(f, refusing_finder.RefusingFinder) for f in sys.meta_path) == 1


@pytest.mark.parametrize("module, needs, extra", [
    ("deepspeed.pipe", "zkit-pipeline", "pipeline"),
    ("deepspeed.ops.adam.cpu_adam", "zkit-offload", "offload"),
    ("deepspeed.ops.lion", "zkit-offload", "offload"),
    ("deepspeed.ops.adagrad", "zkit-offload", "offload"),
    ("deepspeed.ops.sparse_attention", "zkit-sparse", "sparse"),
])
def test_without_an_optional_plugin_the_import_names_the_distribution(monkeypatch, module, needs, extra):
    import deepspeed  # noqa: F401

    monkeypatch.setitem(sys.modules, needs.replace("-", "_"), None)  # as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingPlugin, match=(
            rf"^deepspeed\.\S+ needs {needs}, which is not installed: pip install {needs} "
            rf"\(or the drop-in with its extra, pip install 'deepspeed\[{extra}\]'\)$")):
        importlib.import_module(module)


def test_without_zkit_offload_import_deepspeed_works_and_cpu_adam_names_it(monkeypatch):
    import deepspeed.ops.adam

    monkeypatch.setitem(sys.modules, "zkit_offload", None)
    monkeypatch.delitem(sys.modules, "deepspeed.ops.adam.cpu_adam", raising=False)
    assert deepspeed.ops.adam.FusedAdam is not None
    with pytest.raises(ImportError, match=r"deepspeed\.ops\.adam\.DeepSpeedCPUAdam needs zkit-offload"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401


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


def _clipping_of(config) -> float:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(3, 2), config=config)
    try:
        return engine.gradient_clipping()
    finally:
        engine.close()


def _one_rank_clipping(configs):
    return [_clipping_of(c) for c in configs]


def test_initialize_takes_deepspeeds_default_gradient_clipping_when_the_config_leaves_it_unset(tmp_path):
    """DeepSpeed 0.19.8 clips at 1.0 unless told otherwise; zkit.initialize does not clip. A value
    the config sets, 0 included, is kept; a config file is read as zkit reads it."""
    from zkit.testing import run_ranks

    base = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base))
    got = run_ranks(_one_rank_clipping, 1, args=([base, {**base, "gradient_clipping": 0.0},
                                                  {**base, "gradient_clipping": 0.5}, str(path)],), timeout=300)[0]
    assert got == [1.0, 0.0, 0.5, 1.0]


def test_initialize_reads_a_config_file_as_zkit_does_refusing_a_key_given_twice(tmp_path):
    from zkit.core.config import ConfigError
    from zkit_deepspeed.ignored_keys import drop_ignored_keys

    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "gradient_clipping": 1.0, "gradient_clipping": 0}')
    with pytest.raises(ConfigError, match=rf"^config file '{path}': key 'gradient_clipping' appears twice in one "
                                          r"object \(values 1\.0 and 0\); keep one$"):
        drop_ignored_keys(str(path))
