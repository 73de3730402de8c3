"""The built-in answer to ``zkit_make_monitor``: every metric writer the config enables; the monitor
sections are this plugin's."""
from __future__ import annotations

import zkit
from zkit.core.records import ConfigSectionRecord
from zkit.monitor.config import SECTIONS, monitor_sections
from zkit.monitor.writers import Monitor


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    for path, (schema, description) in SECTIONS.items():
        yield ConfigSectionRecord(path=path, schema=schema, description=description, default_when_absent=True)


@zkit.hookimpl(trylast=True)
def zkit_make_monitor(config, rank):
    return Monitor(monitor_sections(config), rank)
