"""DeepSpeed's own CPU-capable unit-test files under the drop-in: the recorded figures explain every
difference from real DeepSpeed's, the runner reads pytest's results, and, where a DeepSpeed source
tree is given (``ZKIT_DEEPSPEED_SRC``), the drop-in still gives the recorded counts."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from zkit_deepspeed.unit_tests import CPU_CAPABLE_FILES, DEEPSPEED_RESULTS, DIFFERENCES, ZKIT_RESULTS, FileResult

ROOT = Path(__file__).resolve().parents[3]
SRC = os.environ.get("ZKIT_DEEPSPEED_SRC")


def _runner():
    spec = importlib.util.spec_from_file_location("deepspeed_unit_tests", ROOT / "contrib" / "deepspeed_unit_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_difference_from_deepspeed_has_its_reason():
    assert list(CPU_CAPABLE_FILES) == sorted(set(CPU_CAPABLE_FILES))
    assert set(DEEPSPEED_RESULTS) == set(ZKIT_RESULTS) == set(CPU_CAPABLE_FILES)
    unexplained = [f for f in CPU_CAPABLE_FILES if DEEPSPEED_RESULTS[f] != ZKIT_RESULTS[f] and not DIFFERENCES.get(f)]
    assert not unexplained, unexplained
    stale = [f for f in DIFFERENCES if f not in CPU_CAPABLE_FILES or DEEPSPEED_RESULTS[f] == ZKIT_RESULTS[f]]
    assert not stale, stale
    # CPU-capable: real DeepSpeed passes at least one test of each file
    assert all(DEEPSPEED_RESULTS[f].passed > 0 for f in CPU_CAPABLE_FILES)


def test_runner_reads_pytest_junit_counts(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="unit.a.TestX" name="test_ok"/>
      <testcase classname="unit.a.TestX" name="test_bad"><failure message="AssertionError: no">x</failure></testcase>
      <testcase classname="unit.a.TestX" name="test_skip"><skipped message="needs a GPU"/></testcase>
      <testcase classname="unit.a.TestX" name="test_setup"><error message="failed on setup">x</error></testcase>
    </testsuite></testsuites>""")
    assert _runner().parse_junit(xml) == FileResult(passed=1, failed=2, skipped=1, errors=0)
    xml.write_text("""<testsuites><testsuite><testcase classname="" name="unit.b">
      <error message="collection failure">Traceback\nModuleNotFoundError: No module named 'x'</error>
    </testcase></testsuite></testsuites>""")
    result = _runner().parse_junit(xml)
    assert result == FileResult(errors=1) and result.note == "ModuleNotFoundError: No module named 'x'"


def test_runner_needs_a_source_tree(capsys):
    with pytest.raises(SystemExit):
        _runner().main(["--src", str(ROOT / "no-such-tree"), "--side", "zkit"])
    err = capsys.readouterr().err
    assert "--src (or ZKIT_DEEPSPEED_SRC) must name a DeepSpeed source tree holding tests/unit" in err


@pytest.mark.skipif(not SRC, reason="set ZKIT_DEEPSPEED_SRC to a DeepSpeed source tree (git archive HEAD tests) to "
                                    "run DeepSpeed's own unit tests under the drop-in")
@pytest.mark.parametrize("test_file", CPU_CAPABLE_FILES)
def test_deepspeed_unit_test_file_under_the_dropin(test_file):
    runner = _runner()
    result = runner.run_file(Path(sys.executable), Path(SRC), test_file, timeout=900)
    assert result == ZKIT_RESULTS[test_file], result.note
