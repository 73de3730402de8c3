"""zkit hooks of the deepspeed drop-in: a ``zkit report`` line."""
from __future__ import annotations

import zkit
from zkit_deepspeed.alias import active_deepspeed


@zkit.hookimpl
def zkit_report():
    yield "deepspeed", active_deepspeed().describe()
