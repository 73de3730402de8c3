"""The built-in plugin that applies the ``activation_checkpointing`` section to each engine."""
from __future__ import annotations

import zkit
from zkit.activations import checkpointing


@zkit.hookimpl(tryfirst=True)
def zkit_engine_setup(engine):
    # first: other plugins' setup (a pipeline's tensor-parallel group) reconfigures on top of it
    checkpointing.configure(engine)
