"""torch.compile under the engine: ``engine.compile()`` (DeepSpeed's call) and a compiled module
given to ``initialize`` train every ZeRO stage with the losses of the eager run (``zkit.core.compile``).

The backends are Dynamo's ``aot_eager`` (forward and backward graphs through AOTAutograd, run by
torch's kernels) and ``eager`` (Dynamo's graphs alone): they check the capture without paying for
code generation."""
import pytest
import torch

import zkit
from zkit.testing import run_ranks

import compile_ranks as cr
import engine_ranks as er

ONE_RANK = [(0, "engine.compile", "aot_eager"), (1, "engine.compile", "aot_eager"), (1, "torch.compile(model)", "aot_eager"),
            (2, "engine.compile", "aot_eager")]
TWO_RANKS = [(0, "engine.compile", "eager"), (1, "engine.compile", "eager"), (2, "engine.compile", "eager"),
             (2, "torch.compile(model)", "eager")]


def _check_same_as_eager(results: dict) -> None:
    for stage, runs in results.items():
        eager = runs.pop("eager")
        assert not eager["compiled"]
        for how, run in runs.items():
            assert run["compiled"], (stage, how)
            assert run["graphs"] >= 1, f"stage {stage}, {how}: nothing was compiled"
            assert run["names"] == eager["names"], "the engine trains the model itself, not the compiled wrapper"
            assert run["losses"] == pytest.approx(eager["losses"], rel=1e-6), (stage, how)
            diff = max((a - b).abs().max().item() for a, b in zip(run["params"], eager["params"]))
            assert diff < 1e-6, (stage, how, diff)


def test_stages_0_to_2_train_compiled_as_eager_on_one_rank():
    (results,) = run_ranks(cr.compare, 1, args=(ONE_RANK,), timeout=600)
    assert sorted(results) == [0, 1, 2]
    _check_same_as_eager(results)


def test_stages_0_to_2_train_compiled_as_eager_on_two_ranks():
    results = run_ranks(cr.compare, 2, args=(TWO_RANKS,), timeout=600)
    stage2 = [r[2]["engine.compile"]["params"] for r in results]
    assert all(torch.equal(a, b) for a, b in zip(*stage2)), "ranks ended with different parameters"
    for rank_results in results:
        _check_same_as_eager(rank_results)


def _engine(stage=0, model=None):
    return zkit.initialize(model=er.make_model() if model is None else model, config=er.config(stage, "fp32", 1, 1))[0]


STAGE3 = r"torch.compile of a whole model with ZeRO stage 3 is not supported: stage 3 turns each released parameter"


@pytest.mark.parametrize("world, persistence, offload", ((1, 0, False), (2, 0, False), (2, 10**6, False),
                                                       (1, 0, True), (2, 0, True)))
def test_stage_3_compiles_block_by_block_with_the_eager_losses(world, persistence, offload):
    """engine.compile at stage 3 compiles each block's forward, gathered before it and released
    after it outside the compiled code: the eager run's losses, one graph for the three equal
    blocks, none compiled after the second step, no graph break. With parameters and optimizer on
    the host too (their units are blocks as well)."""
    results = run_ranks(cr.stage3_regions, world, args=(persistence, offload), timeout=600)
    for r in results:
        eager, compiled = r["eager"], r["engine.compile"]
        assert compiled["compiled"] and not eager["compiled"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6, abs=1e-7)
        assert compiled["graphs"][1] == compiled["graphs"][-1] == 1, compiled["graphs"]
        assert compiled["breaks"] == 0


def test_stage_3_refuses_a_compiled_module_at_initialize_and_module_units_at_engine_compile():
    """Compiled whole, stage 3 trained with the eager run's losses, but Dynamo compiled the forward
    again at every step (the released placeholders' strides differ from the gathered parameters'):
    refused, by name; engine.compile compiles block by block, which needs block units."""
    with pytest.raises(ValueError, match=STAGE3 + r".*call it after initialize"):
        _engine(3, torch.compile(er.make_model(), backend="eager"))
    config = er.config(3, "fp32", 1, 1)
    config["zero_optimization"]["stage3_gather_unit"] = "module"
    engine = zkit.initialize(model=er.make_model(), config=config)[0]
    with pytest.raises(ValueError, match=STAGE3 + r'.*stage3_gather_unit \"block\".*\(partitioner \'zero3\' of zkit\)'):
        engine.compile(backend="eager")
    assert not engine.is_compiled
    engine.close()


def test_a_partitioner_record_s_compile_refusal_is_raised_naming_the_record():
    """The kernel knows no ZeRO stage: any partitioner record may say why it cannot train a
    compiled module, and both ways in raise that reason with the record's name."""
    from zkit.core.compile import compile_in_place, compile_module
    from zkit.core.records import PartitionerRecord

    record = PartitionerRecord(name="Mine", factory=object, compile_refusal="mine swaps parameters in forward",
                               dist="zkit-mine")
    module = torch.nn.Linear(2, 2)
    expected = r"^mine swaps parameters in forward \(partitioner 'mine' of zkit-mine\)$"
    with pytest.raises(ValueError, match=expected):
        compile_module(module, record, "eager", None)
    with pytest.raises(ValueError, match=expected):
        compile_in_place(module, record, lambda call: call)
    assert not zkit.core.compile.is_compiled(module)
    compile_module(module, PartitionerRecord(name="other", factory=object), "eager", None)
    assert zkit.core.compile.is_compiled(module)


def test_deepcompile_schedules_and_compiled_autograd_are_refused_by_name():
    engine = _engine()
    with pytest.raises(ValueError, match=r"engine.compile\(schedule=...\) configures DeepSpeed's DeepCompile"):
        engine.compile(backend="eager", schedule=[(0, ["zero3_compile"])])
    with pytest.raises(ValueError, match=r"compiled_autograd_enabled=True\) is not supported: ZeRO's gradient hooks"):
        engine.compile(backend="eager", compiled_autograd_enabled=True)
    assert not engine.is_compiled
    engine.close()


def test_a_second_compile_does_nothing_and_compile_kwargs_cannot_change_the_backend(caplog):
    engine = _engine()
    with caplog.at_level("WARNING", logger="zkit"):
        engine.compile(backend="eager", compile_kwargs={"backend": "inductor", "dynamic": False})
    assert "the backend in compile_kwargs is overridden by backend='eager'" in caplog.text
    compiled = engine.module._compiled_call_impl
    engine.compile(backend="aot_eager")
    assert engine.module._compiled_call_impl is compiled
    engine.close()
