"""Plugin-owned config sections: structured with the plugin's schema when it is installed."""
from __future__ import annotations

import attrs
import pytest

from zkit.core.config import ConfigError, load_config
from zkit.core.plugin_manager import builtin_config_sections
from zkit.core.records import ConfigSectionRecord
from zkit.zero.config import zero_config


@attrs.frozen(kw_only=True)
class OffloadSchema:
    device: str = attrs.field(default="none", validator=attrs.validators.in_(("none", "cpu", "nvme")))
    pin_memory: bool = False
    buffer_count: int = 4


@attrs.frozen(kw_only=True)
class PipelineSchema:
    stages: int | str = "auto"
    partition: str = "best"


@attrs.frozen(kw_only=True)
class NeedsName:
    name: str


def record(path, schema, dist="zkit-test"):
    return ConfigSectionRecord(path=path, schema=schema, dist=dist)


SECTIONS = {
    **builtin_config_sections(),
    "zero_optimization.offload_optimizer": record("zero_optimization.offload_optimizer", OffloadSchema, "zkit-offload"),
    "pipeline": record("pipeline", PipelineSchema, "zkit-pipeline"),
}
BASE = {"train_batch_size": 4}


def test_sections_are_structured_and_reachable():
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 8.0}},
                       "pipeline": {"stages": 2}}, world_size=1, sections=SECTIONS)
    off = cfg.section("zero_optimization.offload_optimizer")
    assert off == OffloadSchema(device="cpu", buffer_count=8)
    assert zero_config(cfg).offload_optimizer is off
    assert cfg.section("pipeline") == PipelineSchema(stages=2)
    assert cfg.section("sparse_attention") is None
    d = cfg.to_dict()
    assert d["pipeline"] == {"stages": 2, "partition": "best"}
    assert d["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert load_config(d, world_size=1, sections=SECTIONS) == cfg
    # a loaded config remembers its sections when validated again
    assert load_config(cfg, world_size=2).section("pipeline") == PipelineSchema(stages=2)


def test_plugin_schema_may_accept_auto():
    cfg = load_config({**BASE, "pipeline": {"stages": "auto"}}, world_size=1, sections=SECTIONS)
    assert cfg.section("pipeline").stages == "auto"


def test_legacy_cpu_offload_goes_to_the_plugin():
    cfg = load_config({**BASE, "zero_optimization": {"cpu_offload": True, "cpu_offload_use_pin_memory": True}},
                      world_size=1, sections=SECTIONS)
    assert zero_config(cfg).offload_optimizer == OffloadSchema(device="cpu", pin_memory=True)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"devic": "cpu"}, "unknown config key 'zero_optimization.offload_optimizer.devic'; "
                           "did you mean 'zero_optimization.offload_optimizer.device'?"),
        ({"buffer_count": "x"}, "config key 'zero_optimization.offload_optimizer.buffer_count' must be an int, got 'x'"),
        ({"pin_memory": 1}, "config key 'zero_optimization.offload_optimizer.pin_memory' must be a bool (true or false), got 1"),
        ({"buffer_count": "auto"}, "config key 'zero_optimization.offload_optimizer.buffer_count' is \"auto\""),
        ({"device": "disk"}, "config section 'zero_optimization.offload_optimizer' is invalid: 'device' must be in "
                             "('none', 'cpu', 'nvme') (got 'disk')"),
    ],
)
def test_plugin_sections_are_strict(section, message):
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "zero_optimization": {"offload_optimizer": section}}, world_size=1, sections=SECTIONS)
    assert str(info.value).startswith(message)


def test_required_plugin_key():
    sections = {"zkit_test": record("zkit_test", NeedsName)}
    with pytest.raises(ConfigError, match="^config key 'zkit_test.name' is required$"):
        load_config({**BASE, "zkit_test": {}}, world_size=1, sections=sections)
    assert load_config({**BASE, "zkit_test": {"name": "x"}}, world_size=1, sections=sections).section("zkit_test").name == "x"


def test_unknown_key_suggests_plugin_sections():
    with pytest.raises(ConfigError, match="did you mean 'pipeline'"):
        load_config({**BASE, "pipelin": {}}, world_size=1, sections=SECTIONS)
    with pytest.raises(ConfigError, match="did you mean 'sparse_attention'"):
        load_config({**BASE, "sparse_atention": {}}, world_size=1)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"fp16": record("fp16", OffloadSchema)},
         "config section 'fp16' registered by 'zkit-test': 'fp16' is a built-in key of zkit"),
        ({"nowhere.x": record("nowhere.x", OffloadSchema)},
         "config section 'nowhere.x' registered by 'zkit-test': 'nowhere' is not a config section"),
        ({"pipeline": record("pipelines", PipelineSchema)},
         "config section 'pipeline' registered by 'zkit-test' names a different path, 'pipelines'"),
        ({"pipeline": record("pipeline", dict)},
         "config section 'pipeline' registered by 'zkit-test': schema must be an attrs class, got <class 'dict'>"),
    ],
)
def test_bad_section_records(sections, message):
    with pytest.raises(ConfigError) as info:
        load_config(BASE, world_size=1, sections=sections)
    assert str(info.value) == message
