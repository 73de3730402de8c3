"""The sparse_attention section is validated when the config is loaded, as the kernel's sections
are: an unknown mode or a key the mode does not use is refused at initialize, by name."""
from __future__ import annotations

import pytest

from zkit.core.config import ConfigError, load_config
from zkit.core.plugin_manager import get_plugin_manager


def _load(section: dict) -> None:
    load_config({"train_batch_size": 1, "sparse_attention": section}, world_size=1,
                sections=get_plugin_manager().config_sections())


def test_unknown_mode_is_refused_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown sparse attention layout 'bogus'.*registered: bigbird"):
        _load({"mode": "bogus"})


def test_a_key_the_mode_does_not_use_is_refused():
    with pytest.raises(ConfigError, match="num_random_blocks not used by mode 'fixed'"):
        _load({"mode": "fixed", "num_random_blocks": 2})


def test_a_valid_section_loads():
    _load({"mode": "bigbird", "block": 16, "num_random_blocks": 1})
