"""The zkit side of the ``deepspeed`` drop-in distribution.

:mod:`zkit_deepspeed.alias` makes ``deepspeed`` and every ``deepspeed.X`` the module objects of
``zkit.compat.deepspeed`` and ``zkit.compat.deepspeed.X``; :mod:`zkit_deepspeed.plugin` tells
``zkit report`` which ``deepspeed`` an ``import deepspeed`` gives on this machine.
"""
from zkit_deepspeed.alias import TARGET, active_deepspeed, install

__all__ = ["TARGET", "active_deepspeed", "install"]
