"""zkit's own optimizer and learning-rate schedule classes (the built-in plugins
:mod:`zkit.optim.plugin` and :mod:`zkit.lr_schedules.plugin` register them by name)."""
from __future__ import annotations

from zkit.optim.lamb import Lamb

__all__ = ["Lamb"]
