"""Profiler ranges (``zkit.core.profiling``): a trace of a step names the engine's phases and each
ZeRO-3 gather and release by module; with no profiler running no range is opened."""
import torch

import zkit
from zkit.core import profiling

import engine_ranks as er


def _stage3_engine():
    cfg = er.config(3, "fp32", 1, 1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every unit gathered and released
    cfg["zero_optimization"]["stage3_gather_unit"] = "module"  # a unit, and a trace range, a module
    return zkit.initialize(model=er.make_model(), config=cfg)[0]


def _step(engine):
    ids, labels = er.global_batches(1, 1, 1)
    loss = engine(ids[:2], labels[:2])
    engine.backward(loss)
    engine.step()


def test_a_trace_of_a_step_names_the_phases_and_each_module_gather_and_release():
    engine = _stage3_engine()
    _step(engine)  # the first step records the module order; the traced one prefetches along it
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(engine)
    names = {e.name for e in prof.events()}
    engine.close()
    for phase in ("forward", "backward", "optimizer.step"):
        assert f"zkit {phase}" in names
    for module in ("embed", "mix", "norm"):
        assert f"zkit gather '{module}'" in names
        assert f"zkit release '{module}'" in names
    assert any(n.startswith("zkit reduce ") for n in names)


def test_no_range_is_opened_without_a_profiler(monkeypatch):
    engine = _stage3_engine()
    opened, original = [], torch.autograd.profiler.record_function

    def counting(name, *args):
        opened.append(name)
        return original(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    _step(engine)
    _step(engine)
    engine.close()
    assert not profiling.enabled()
    assert [n for n in opened if n.startswith(profiling.PREFIX)] == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiling.enabled()
