"""``backend="auto"`` follows the measured GPU table, and the docs show that table."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zkit_sparse import FixedSparsityConfig, SparseSelfAttention, backend_table, backends
from zkit_sparse.backend_table import GPU_TABLE, Measured

DOCS = Path(__file__).parents[3] / "docs" / "plugins" / "sparse.md"


@pytest.fixture
def every_backend_usable(monkeypatch):
    monkeypatch.setattr(backends, "flex_unavailable_reason", lambda device_type="cuda": None)
    monkeypatch.setattr(backends, "numba_unavailable_reason", lambda block: None)


@pytest.mark.parametrize("row", GPU_TABLE, ids=lambda r: f"{r.layout}-{r.seq}")
def test_auto_runs_each_measured_case_on_its_fastest_usable_backend(every_backend_usable, row):
    ranked = sorted((n for n in row.ms if n != "dense"), key=row.ms.__getitem__)
    pick = lambda dropout: backends.auto_backend(  # noqa: E731
        "cuda", torch.bfloat16, dropout, 64, row.seq, row.density)
    assert pick(0.0) == ranked[0]
    assert pick(0.1) == [n for n in ranked if n != "flex"][0]  # flex has no dropout


def test_measured_order_differs_by_length_and_auto_follows_it(every_backend_usable):
    # H100: numba beat torch at 4096 tokens, torch beat numba at 16384; with dropout (no flex)
    # auto follows, and lengths between go to the nearest measured one (log scale)
    auto = lambda seq, density=0.14: backends.auto_backend(  # noqa: E731
        "cuda", torch.bfloat16, 0.1, 64, seq, density)
    assert [auto(s) for s in (1024, 4096, 8191, 8192, 8193, 16384, 131072)] == \
        ["numba", "numba", "numba", "numba", "torch", "torch", "torch"]


def test_nearest_row_breaks_length_ties_by_density():
    table = (Measured("a", 4096, 0.1, {"flex": 2.0, "torch": 1.0}),
             Measured("b", 4096, 0.5, {"flex": 1.0, "torch": 2.0}))
    assert backend_table.fastest(4096, 0.2, ("flex", "torch"), table) == "torch"
    assert backend_table.fastest(4096, 0.4, ("flex", "torch"), table) == "flex"
    assert backend_table.fastest(4096, 0.4, ("torch",), table) == "torch"


def test_module_asks_with_its_length_and_layout_density(monkeypatch):
    seen = []
    monkeypatch.setattr(backends, "auto_backend", lambda *args: seen.append(args) or "torch")
    attn = SparseSelfAttention(FixedSparsityConfig(2, block=16, num_local_blocks=4,
                                                   attention="unidirectional"), max_seq_length=256)
    q = torch.zeros(1, 2, 128, 8)
    assert attn.backend_for(q) == "torch"
    density = attn.layout(128).bool().float().mean().item()
    assert seen == [("cpu", torch.float32, 0.0, 16, 128, density)]


def test_docs_show_the_table_auto_follows():
    text = DOCS.read_text()
    assert backend_table.markdown() in text
    assert backend_table.MEASURED_ON.split(": ")[1] in text
