"""The built-in answer to ``zkit_make_monitor``: every metric writer the config enables."""
from __future__ import annotations

import zkit
from zkit.monitor.writers import Monitor


@zkit.hookimpl(trylast=True)
def zkit_make_monitor(engine):
    return Monitor(engine.config, engine.rank)
