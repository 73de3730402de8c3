"""A section a built-in package reads is that package's: zkit.zero registers ``zero_optimization``
and chooses the partitioner from it; the kernel's config reads neither. Blocking the plugin makes
its keys an error naming it, and leaves no partitioner chosen unless the user or a plugin chooses one."""
from __future__ import annotations

import attrs
import pytest
import torch

import zkit
from zkit.core.config import ConfigError, load_config
from zkit.core.plugin_manager import get_plugin_manager
from zkit.core.stack import Stack, configure
from zkit.zero.config import ZeroConfig, zero_config

BASE = {"train_batch_size": 2}


class LossModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def test_the_section_is_zkit_zeros_and_holds_its_defaults_when_absent():
    config = load_config(BASE, world_size=1)
    assert "zero_optimization" not in attrs.fields_dict(type(config))
    assert zero_config(config) == ZeroConfig()
    assert config.section("zero_optimization") == ZeroConfig()
    assert config.to_dict()["zero_optimization"]["stage"] == 0
    again = load_config(config, world_size=1)
    assert zero_config(again) == ZeroConfig() and again.to_dict() == config.to_dict()
    assert load_config(config.to_dict(), world_size=1).to_dict() == config.to_dict()


def test_a_blocked_zero_plugin_makes_its_keys_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.partitioners")
    for sections in (None, get_plugin_manager().config_sections()):
        with pytest.raises(ConfigError) as info:
            load_config({**BASE, "zero_optimization": {"stage": 1}}, world_size=1, sections=sections)
        assert str(info.value) == (
            "config key 'zero_optimization' is provided by zkit's built-in plugin 'zkit.partitioners', which is "
            "blocked (ZKIT_BLOCK_PLUGINS or zkit -p no:zkit.partitioners): unblock it, or remove the key"
        )
    # null asks for nothing; the offload plugin's sections under it are dropped, not refused
    config = load_config({**BASE, "zero_optimization": None}, world_size=1,
                         sections=get_plugin_manager().config_sections())
    assert config.section("zero_optimization") is None and zero_config(config) == ZeroConfig()


def test_a_blocked_zero_plugin_leaves_no_partitioner_and_initialize_says_what_to_do(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.partitioners")
    with pytest.raises(ValueError) as info:
        zkit.initialize(model=LossModel(), config={**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert str(info.value) == (
        "no partitioner is chosen: the config's zero_optimization.stage chooses one through the built-in plugin "
        "'zkit.partitioners', which is blocked (ZKIT_BLOCK_PLUGINS or zkit -p no:zkit.partitioners), and no other "
        "plugin chose one. Pass zkit.Stack(partitioner=NAME) with a partitioner record's name, or unblock "
        "zkit.partitioners"
    )


def test_the_stage_chooses_the_partitioner_and_a_user_stack_wins():
    cfg = {**BASE, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zkit.initialize(model=LossModel(), config=cfg)
    assert engine.records["partitioner"].name == "zero2" and engine.zero_optimization_stage() == 2
    engine, *_ = zkit.initialize(model=LossModel(), config=cfg, stack=Stack(partitioner="zero1"))
    assert engine.records["partitioner"].name == "zero1" and engine.zero_optimization_stage() == 1


class ChoosesStage1:
    @zkit.hookimpl
    def zkit_configure(self, config):
        return Stack(partitioner="zero1")


class ChoosesStage3:
    @zkit.hookimpl
    def zkit_configure(self, config):
        return Stack(partitioner="zero3")


def test_an_installed_plugins_choice_wins_over_the_built_in_one_and_two_of_them_clash():
    config = load_config({**BASE, "zero_optimization": {"stage": 2}}, world_size=1)
    pm = get_plugin_manager(autoload=False, extra_plugins=[ChoosesStage1()])
    assert configure(pm, Stack(), config)[1]["partitioner"].name == "zero1"
    pm = get_plugin_manager(autoload=False, extra_plugins=[ChoosesStage1(), ChoosesStage3()])
    with pytest.raises(ValueError, match=r"both choose the partitioner: 'zero1' vs 'zero3'\. Choose one with "
                                         r"zkit\.Stack\(partitioner=\.\.\.\)"):
        configure(pm, Stack(), config)


@pytest.mark.parametrize("plugin, key", [("zkit.monitor", "tensorboard"), ("zkit.monitor", "csv_monitor"),
                                         ("zkit.telemetry", "flops_profiler")])
def test_a_blocked_monitor_or_telemetry_plugin_makes_its_keys_an_error_naming_it(monkeypatch, plugin, key):
    assert load_config({**BASE, key: {"enabled": False}}, world_size=1).section(key).enabled is False
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", plugin)
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, key: {"enabled": False}}, world_size=1)
    assert str(info.value) == (
        f"config key '{key}' is provided by zkit's built-in plugin '{plugin}', which is blocked "
        f"(ZKIT_BLOCK_PLUGINS or zkit -p no:{plugin}): unblock it, or remove the key"
    )


def test_keys_inside_a_moved_section_are_suggested():
    with pytest.raises(ConfigError, match=r"unknown config key 'tensorboard.job_nam'; did you mean "
                                          r"'tensorboard.job_name'\?"):
        load_config({**BASE, "tensorboard": {"job_nam": "x"}}, world_size=1)
    with pytest.raises(ConfigError, match=r"unknown config key 'tensorbord'; did you mean 'tensorboard'\?"):
        load_config({**BASE, "tensorbord": {}}, world_size=1)
