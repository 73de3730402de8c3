"""Composition as a property: every pair of features matches its reference or is refused at
initialize with an error naming both (the matrix is declared in tests/composition.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

import composition as matrix
from background import Command, call, returned

pytest.importorskip("zkit_offload")
pytest.importorskip("zkit_onebit")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
CELLS = [p for p in matrix.pairs() if p not in matrix.NOT_A_COMBINATION and p not in matrix.ELSEWHERE]


def _matrix(root: Path) -> list[Command]:
    """Every cell's result: the references with the cells, each world size in a process group of its own."""
    references = sorted({matrix.reference_of(p) for p in CELLS if matrix.expected(p) == "matches"})
    # an overlapped offload's twin: the pair's cpu_offload cell, a cell of the matrix already
    twins = sorted({matrix.overlap_twin(p) for p in CELLS if matrix.expected(p) == "matches"} - {None})
    one_setting = [p for p in matrix.NOT_A_COMBINATION if p in matrix.REFUSED]
    cells = list(dict.fromkeys([*references, *CELLS, *twins, *one_setting]))
    (root / "nvme").mkdir()
    (root / "ckpt").mkdir()
    return [call(root, "composition_ranks:run_matrix", cells, str(root / "nvme"), str(root / "ckpt"))]


#: run beside the other tests from the session's start, in a process of its own (tests/background.py)
BACKGROUND = {"results": _matrix}


@pytest.fixture(scope="module")
def results(background, request) -> dict:
    return returned(*background.wait(request))


@pytest.mark.parametrize("pair", CELLS, ids=lambda p: "x".join(p))
def test_pair(results, pair):
    got = results[pair]
    assert "crashed" not in got, f"{pair} was accepted at initialize and crashed later:\n{got.get('crashed')}"
    if matrix.expected(pair) == "refused":
        assert "refused" in got, f"{pair} is declared refused but trained"
        for word in matrix.REFUSED[pair][1]:
            assert word.lower() in got["refused"].lower(), (pair, got["refused"])
        return
    assert "refused" not in got, f"{pair} is declared to work but initialize refused it: {got['refused']}"
    if matrix.expected(pair) == "refused at checkpoint":
        assert "refused_checkpoint" in got, f"{pair} is declared refused at its checkpoint but saved and loaded"
        for word in matrix.REFUSED_AT_CHECKPOINT[pair][1]:
            assert word.lower() in got["refused_checkpoint"].lower(), (pair, got["refused_checkpoint"])
        return
    assert "refused_checkpoint" not in got, f"{pair}: its checkpoint was refused: {got['refused_checkpoint']}"
    assert not got["missing"], f"{pair} matches nothing: a feature left no trace: {got['missing']}"
    reference = results[matrix.reference_of(pair)]
    assert "params" in reference, (matrix.reference_of(pair), reference)
    tol = matrix.tolerance(pair)
    assert got["params"] and set(got["params"]) <= set(reference["params"]), pair
    for name, a in got["params"].items():  # a pipeline stage holds its own layers
        b = reference["params"][name]
        scale = b.abs().max().clamp_min(matrix.scale_floor(pair))
        assert ((a - b).abs().max() / scale).item() <= tol, (pair, name, (a - b).abs().max().item(), scale.item())
    twin = matrix.overlap_twin(pair)  # the overlapped offload makes the step after backward's update exactly
    if twin is not None:
        assert "params" in results[twin], (twin, results[twin])
        for name, a in got["params"].items():
            assert a.equal(results[twin]["params"][name]), (pair, twin, name)


@pytest.mark.parametrize("pair", sorted(p for p in matrix.NOT_A_COMBINATION if p in matrix.REFUSED),
                         ids=lambda p: "x".join(p))
def test_two_values_of_one_setting_are_refused(results, pair):
    assert "refused" in results[pair]
    for word in matrix.REFUSED[pair][1]:
        assert word.lower() in results[pair]["refused"].lower(), (pair, results[pair]["refused"])


def test_compatibility_page_is_the_matrix():
    assert DOCS.read_text(encoding="utf-8") == matrix.markdown(), (
        "docs/compatibility.md is stale: run python tests/composition.py > docs/compatibility.md"
    )
