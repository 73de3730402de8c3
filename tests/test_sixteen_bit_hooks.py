"""The engine's 16-bit saves go through the hooks ``zkit_save_16bit_model`` and
``zkit_consolidated_16bit_state_dict`` (answered by the built-in ``zkit.checkpoint_formats``), and
its state offload through the partitioner interface, whose default refuses."""
from __future__ import annotations

import types

import pytest
import torch

import zkit
from zkit.core.partitioner import Partitioner
from zkit.testing import run_ranks

import sixteen_bit_ranks as sbr

CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _engine(stack=None):
    return zkit.initialize(model=torch.nn.Linear(4, 2), config=CONFIG, stack=stack)[0]


class Saver:
    def __init__(self):
        self.calls = []

    @zkit.hookimpl
    def zkit_save_16bit_model(self, engine, path, exclude_frozen_parameters):
        self.calls.append((path.name, exclude_frozen_parameters))
        return True


def test_a_plugin_answering_the_hook_saves_instead_of_the_built_in(tmp_path):
    saver = Saver()
    engine = _engine(zkit.Stack(plugins=[saver]))
    assert engine.save_16bit_model(str(tmp_path), "w.bin", exclude_frozen_parameters=True) is True
    assert saver.calls == [("w.bin", True)] and not (tmp_path / "w.bin").exists()


def test_without_the_checkpoint_plugin_16bit_saves_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.checkpoint_formats")
    engine = _engine()
    with pytest.raises(RuntimeError, match="engine.save_16bit_model: no plugin answers the hook zkit_save_16bit_model "
                                           "\\(the built-in zkit.checkpoint_formats provides it: is it blocked\\?\\)"):
        engine.save_16bit_model(str(tmp_path))
    with pytest.raises(RuntimeError, match="engine.consolidated_16bit_state_dict: no plugin answers the hook "
                                           "zkit_consolidated_16bit_state_dict"):
        engine.consolidated_16bit_state_dict()
    assert not list(tmp_path.iterdir())


def test_consolidated_state_dict_needs_stage_3():
    with pytest.raises(ValueError, match="consolidated_16bit_state_dict requires ZeRO stage 3 \\(at stages 0-2 every "
                                         "rank holds the whole model: use engine.module.state_dict\\(\\)\\)"):
        _engine().consolidated_16bit_state_dict()


def test_consolidated_state_dict_is_whole_on_rank_0_and_none_elsewhere():
    out = run_ranks(sbr.consolidated_stage3, 2, timeout=120)
    assert out[1]["state"] is None
    state, expected = out[0]["state"], out[0]["expected"]
    assert set(state) == set(expected)
    for k in expected:
        assert state[k].dtype == torch.bfloat16 and torch.equal(state[k], expected[k]), k


class Replicated(Partitioner):
    """A third-party partitioner that implements only what is abstract."""

    def after_backward(self, boundary): ...
    def grad_norm(self): ...
    def step(self, grad_factor): ...
    def zero_grad(self): ...
    def pieces(self): ...


def test_a_partitioner_without_state_offload_refuses_it():
    part = Replicated(types.SimpleNamespace(module=None, comm=None, allocator=None))
    assert part.offloaded_states() == []
    part.reload_states(non_blocking=False)  # nothing offloaded: nothing to do
    with pytest.raises(NotImplementedError, match="engine.offload_states\\(\\): the partitioner Replicated cannot "
                                                  "move its states off the device"):
        part.offload_states(None, "cpu", True, False)
