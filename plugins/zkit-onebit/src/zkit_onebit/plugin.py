"""zkit plugin entry point of zkit-onebit: the hook implementations zkit discovers."""
from __future__ import annotations

import zkit


@zkit.hookimpl
def zkit_report():
    yield "zkit-onebit", "installed (work in progress)"
