"""zkit hooks of the deepspeed drop-in: a ``zkit report`` line and the ``"deepspeed"`` checkpoint
format (DeepSpeed's checkpoints load into zkit and consolidate)."""
from __future__ import annotations

import zkit
from zkit_deepspeed.active import active_deepspeed
from zkit_deepspeed.checkpoint.format import RECORD


@zkit.hookimpl
def zkit_report():
    yield "deepspeed", active_deepspeed().describe()


@zkit.hookimpl
def zkit_register_checkpoint_formats():
    yield RECORD
