"""The zkit side of the ``deepspeed`` drop-in distribution (the ``deepspeed`` package beside it
holds DeepSpeed's names on zkit).

:mod:`zkit_deepspeed.refusing_finder` makes imports of the ``deepspeed.X`` modules zkit refuses
say so; :mod:`zkit_deepspeed.optional` imports the optional zkit plugins behind some names;
:mod:`zkit_deepspeed.active` and :mod:`zkit_deepspeed.plugin` tell ``zkit report`` which
``deepspeed`` an ``import deepspeed`` gives on this machine.
"""
from zkit_deepspeed.active import active_deepspeed

__all__ = ["active_deepspeed"]
