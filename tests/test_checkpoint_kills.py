"""A save killed at any point leaves a checkpoint that loads, an overwrite of its own tag included,
and no later save removes the only complete copy: the save is cut after each of its file-system
steps (every rename, replace, unlink and rmdir), the directory is loaded, and a next save is
checked after each of its own steps. One real SIGKILL, between the two renames of an overwrite,
in a process of its own."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zkit

import engine_ranks as er

_STEPS = ("rename", "replace", "unlink", "rmdir")


class Killed(BaseException):
    """Stands for SIGKILL: no ``except Exception`` catches it (a save's clean-up does not run)."""


def _engine(steps: int):
    engine = zkit.initialize(model=er.make_model(), config=er.config(2, "fp32", 1, 1))[0]
    er.train_engine(engine, steps, 1, 1)
    return engine


def _masters(engine) -> list[torch.Tensor]:
    return [p.master.detach().clone() for p in engine.partitioner.pieces()]


class _Steps:
    """Counts the file-system steps of the process; calls ``after(n)`` after the n-th."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        self.after = None
        for name in _STEPS:
            monkeypatch.setattr(os, name, self._counted(getattr(os, name)))

    def _counted(self, real):
        def step(*args, **kwargs):
            result = real(*args, **kwargs)
            after, self.after = self.after, None  # not re-entered by what ``after`` does
            if after is not None:
                self.n += 1
                try:
                    after(self.n)
                finally:
                    if self.after is None:
                        self.after = after
            return result

        return step

    def run(self, fn, after) -> None:
        self.n, self.after = 0, after
        try:
            fn()
        finally:
            self.after = None


def test_a_save_killed_after_any_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    first, second, third = _engine(1), _engine(2), _engine(3)
    saved = {name: _masters(e) for name, e in (("first", first), ("second", second), ("third", third))}
    template = tmp_path / "template"
    first.save_checkpoint(str(template), tag="last")
    reader = zkit.initialize(model=er.make_model(seed=1), config=er.config(2, "fp32", 1, 1))[0]

    def loaded(where: Path) -> str:
        """Which saved state ``load_checkpoint(where)`` gives."""
        reader.load_checkpoint(str(where))
        got = _masters(reader)
        return next(name for name, masters in saved.items() if all(map(torch.equal, masters, got)))

    steps = _Steps(monkeypatch)
    killed_at = 0
    while True:
        killed_at += 1
        where = tmp_path / f"killed_after_{killed_at}"
        shutil.copytree(template, where)

        def kill(n: int) -> None:
            if n == killed_at:
                raise Killed

        try:
            steps.run(lambda: second.save_checkpoint(str(where), tag="last"), kill)
        except Killed:
            pass
        else:
            break  # the save has fewer steps: every one was cut
        assert loaded(where) in ("first", "second"), killed_at
        # the next job's save of the same tag: a complete copy loads after each of its steps
        seen = []
        steps.run(lambda: third.save_checkpoint(str(where), tag="last"), lambda n: seen.append(loaded(where)))
        assert set(seen) <= {"first", "second", "third"} and seen, (killed_at, seen)
        assert loaded(where) == "third"
        assert sorted(p.name for p in where.iterdir()) == ["last", "latest"], killed_at
    assert killed_at > 6  # the steps of an overwrite: rank file, metadata, two renames, removal, latest


def test_a_save_killed_between_the_renames_of_an_overwrite_keeps_the_previous_checkpoint(tmp_path, caplog):
    # SIGKILL right after "last" was renamed to ".last.old": loading said "last/meta.msgpack: no
    # checkpoint metadata", and the next job's save of "last" removed ".last.old".
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import engine_ranks as er, zkit
        engine = zkit.initialize(model=er.make_model(), config=er.config(2, "fp32", 1, 1))[0]
        er.train_engine(engine, 1, 1, 1)
        engine.save_checkpoint({str(tmp_path)!r}, tag="last")
        er.train_engine(engine, 1, 1, 1, start=1)
        rename = os.rename
        def killed_after_setting_aside(src, dst, *args, **kwargs):
            rename(src, dst, *args, **kwargs)
            if str(dst).endswith(".last.old"):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = killed_after_setting_aside
        engine.save_checkpoint({str(tmp_path)!r}, tag="last")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (tmp_path / "last").exists() and (tmp_path / ".last.old" / "meta.msgpack").is_file()
    engine = zkit.initialize(model=er.make_model(seed=1), config=er.config(2, "fp32", 1, 1))[0]
    with caplog.at_level(logging.WARNING, logger="zkit"):
        where, _ = engine.load_checkpoint(str(tmp_path))
    assert where == str(tmp_path / ".last.old") and engine.global_steps == 1
    assert "a save overwriting tag 'last' was interrupted; loading the checkpoint it replaced" in caplog.text
    engine.save_checkpoint(str(tmp_path), tag="other")  # the next save puts it back
    assert (tmp_path / "last" / "meta.msgpack").is_file() and not (tmp_path / ".last.old").exists()


@pytest.mark.parametrize("left", ["missing", "incomplete"])
def test_load_names_the_tag_when_nothing_was_set_aside(tmp_path, left):
    _engine(1).save_checkpoint(str(tmp_path), tag="last")
    shutil.rmtree(tmp_path / "last")
    if left == "incomplete":
        (tmp_path / "last").mkdir()
    with pytest.raises(zkit.checkpoint.CheckpointError, match=r"last/meta.msgpack: no checkpoint metadata"):
        _engine(0).load_checkpoint(str(tmp_path))
