"""PipelineModule and the interpreter: pipeline training equals single-process training."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pp_ranks
from zkit.testing import run_ranks
from zkit_pipeline import LayerSpec, PipelineModule
from zkit_pipeline.partition_layers import balanced_bounds, layer_weights


@pytest.fixture(scope="module")
def two_stages():
    return run_ranks(pp_ranks.all_schedules, 2, timeout=240)


@pytest.mark.parametrize("run", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "1f1b+checkpointing"])
def test_pipeline_training_equals_single_process(two_stages, run):
    for rank, result in enumerate(two_stages):
        r = result[run]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), f"rank {rank}"
        assert r["param_diff"] < 1e-5, f"rank {rank}: parameters differ by {r['param_diff']}"
        assert r["tie_diff"] < 1e-5, f"rank {rank}: tied weight differs by {r['tie_diff']}"


def test_tied_weights_stay_identical_across_stages(two_stages):
    for run in ("1f1b", "zb_h1"):
        a, b = two_stages[0][run]["tied"], two_stages[1][run]["tied"]
        assert a is not None and b is not None and torch.equal(a, b)


def test_layer_specs_are_built_only_on_their_stage():
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    mod = PipelineModule(layers, 2, nn.functional.mse_loss, stage_id=1, partition_method="uniform")
    assert mod.layer_range(0) == (2, 4)
    assert sum(1 for _ in mod.parameters()) == 4  # two Linear layers: weight and bias each


def test_parameters_method_balances_by_size():
    layers = [LayerSpec(nn.Linear, 64, 64), nn.ReLU(), LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)]
    mod = PipelineModule(layers, 2, nn.functional.mse_loss, stage_id=0)
    assert mod.layer_range(0) in ((0, 1), (0, 2))  # the big layer alone (the ReLU holds nothing)


def test_type_method_counts_matching_layers():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.ReLU(), nn.Linear(2, 2)]
    w = layer_weights("type:linear", [0] * 6, [type(x).__name__ for x in layers])
    assert list(w) == [1, 0, 1, 0, 0, 1]


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=30), data=st.data())
def test_balanced_bounds_are_contiguous_nonempty_and_optimal(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    b = balanced_bounds(weights, parts)
    assert b[0] == 0 and b[-1] == len(weights) and len(b) == parts + 1
    assert all(x < y for x, y in zip(b, b[1:]))
    best = max(sum(weights[b[i]:b[i + 1]]) for i in range(parts))
    # exhaustive optimum for small cases
    if len(weights) <= 10:
        import itertools
        opt = min(
            max(sum(weights[c[i]:c[i + 1]]) for i in range(parts))
            for cuts in itertools.combinations(range(1, len(weights)), parts - 1)
            for c in [(0, *cuts, len(weights))]
        )
        assert best == opt


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_stages=4), r"3 layers cannot be split over 4 stages x 1 virtual stages; every stage needs at least one layer"),
        (dict(num_stages=2, virtual_stages=2), r"3 layers cannot be split over 2 stages x 2 virtual stages"),
        (dict(num_stages=2, partition_method="size"), "unknown partition_method 'size'; use 'parameters', 'uniform' or 'type:REGEX'"),
        (dict(num_stages=2, partition_method="type:Conv"), "partition_method 'type:Conv' matches no layer"),
        (dict(num_stages=2, stage_id=2), r"stage_id must be in \[0, 2\), got 2"),
        (dict(num_stages=1, activation_checkpoint_interval=-1), "activation_checkpoint_interval must be >= 0"),
    ],
)
def test_bad_pipeline_modules_are_named(kwargs, message):
    kwargs.setdefault("stage_id", 0)
    with pytest.raises(ValueError, match=message):
        PipelineModule([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)], loss_fn=nn.functional.mse_loss, **kwargs)


def test_schedules_are_registered_as_step_records():
    from zkit.core.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        record = pm.lookup("scheduler", name)
        assert record.kind == "step" and record.dist.startswith("zkit-pipeline")


def test_pipeline_checkpointing_follows_the_activation_checkpointing_config():
    """activation_checkpoint_interval runs through zkit.activations.recompute: the configured profile
    (and CPU copies) apply, and the gradients are those without checkpointing."""
    from zkit.activations import recompute

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
    plain = PipelineModule(layers, 1, None, stage_id=0)
    ckpt = PipelineModule(layers, 1, None, stage_id=0, activation_checkpoint_interval=2)
    x = torch.randn(4, 8)
    plain(x).sum().backward()
    want = [p.grad.clone() for p in plain.parameters()]
    for p in plain.parameters():
        p.grad = None
    recompute.configure({"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}})
    try:
        ckpt(x).sum().backward()
        report = recompute.profile_report()
    finally:
        recompute.reset()
    assert any(name.startswith("pipeline layers") for name in report), report
    for p, g in zip(ckpt.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_deepspeeds_pipeline_section_loads_and_says_where_each_choice_is_made(caplog):
    import logging

    from zkit.core.config import ConfigError, load_config
    from zkit.core.config.structure import _WARNED
    from zkit.core.plugin_manager import get_plugin_manager

    sections = get_plugin_manager().config_sections()
    _WARNED.discard("pipeline.partition")
    with caplog.at_level(logging.WARNING, logger="zkit"):
        cfg = load_config({"train_batch_size": 2, "pipeline": {"stages": "auto", "partition": "uniform"}},
                          world_size=1, sections=sections)
    assert cfg.section("pipeline").partition == "uniform"
    assert "'pipeline.partition' = 'uniform' has no effect in zkit" in caplog.text
    assert "PipelineModule(partition_method=" in caplog.text
    with pytest.raises(ConfigError, match="unknown config key 'pipeline.stagez'; did you mean 'pipeline.stages'"):
        load_config({"train_batch_size": 2, "pipeline": {"stagez": 2}}, world_size=1, sections=sections)
