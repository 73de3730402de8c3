"""The built-in plugin that applies the ``activation_checkpointing`` section to each engine."""
from __future__ import annotations

import zkit
from zkit.activations import recompute
from zkit.activations.config import SECTION, ActivationCheckpointingConfig
from zkit.core.records import ConfigSectionRecord


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    yield ConfigSectionRecord(path=SECTION, schema=ActivationCheckpointingConfig,
                              description="Activation recomputation.", default_when_absent=True)


@zkit.hookimpl(tryfirst=True)
def zkit_engine_setup(engine):
    # first: other plugins' setup (a pipeline's tensor-parallel group) reconfigures on top of it
    recompute.configure(engine)
