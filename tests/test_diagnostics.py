"""A collective that cannot complete ends at the timeout with a report naming ranks and phases."""
import time

import pytest

from zkit.core.phases import phase
from zkit.torch_distributed import diagnostics
from zkit.testing import run_ranks

import engine_ranks as er


def test_diverged_ranks_are_named_with_their_phases():
    start = time.monotonic()
    reports = run_ranks(er.diverged_collectives, 2, timeout=120)
    assert time.monotonic() - start < 100
    for text in reports:
        assert "rank 0: at #1 all_reduce float32[4] on group world in optimizer.step" in text
        assert "rank 1: at #1 recv float32[4] on group world in backward of 'layers.3.mlp'" in text
        assert "diverged: rank 1 is in \"backward of 'layers.3.mlp'\" (recv #1) while rank 0 is in 'optimizer.step'" in text


def test_a_rank_that_stops_communicating_is_reported_missing():
    reports = run_ranks(er.rank_skips_collectives, 2, timeout=120)
    assert reports[1] == "rank 1 slept"
    text = reports[0]
    assert text.startswith("collective failed on rank 0")
    assert "rank 0: at #" in text and "all_reduce" in text and "in backward: reduce '" in text
    assert "rank 1: no report (not inside a collective, stuck in computation, or dead)" in text


def test_timeout_from_the_environment_wins(monkeypatch):
    class Cfg:
        comms_timeout_s = 300.0

    monkeypatch.setenv(diagnostics.ENV_TIMEOUT, "7.5")
    assert diagnostics.timeout_seconds(Cfg()) == 7.5
    monkeypatch.setenv(diagnostics.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="ZKIT_COMMS_TIMEOUT_S must be a number of seconds, got 'soon'"):
        diagnostics.timeout_seconds(Cfg())
    monkeypatch.delenv(diagnostics.ENV_TIMEOUT)
    assert diagnostics.timeout_seconds(Cfg()) == 300.0


def test_fingerprints_carry_the_phase():
    import torch

    log = diagnostics.FingerprintLog("world")
    with phase("backward"), phase("reduce 'w'"):
        fp = log.record("all_reduce", torch.zeros(2, 3))
    assert fp.describe() == "#1 all_reduce float32[2x3] on group world in backward: reduce 'w'"
