"""A third-party zkit plugin: the Signum optimizer, and a ``grad_norm_watch`` config section that
records the global gradient norm of every step (hooks in :mod:`zkit_example_plugin.plugin`)."""
from __future__ import annotations

from zkit_example_plugin.signum import Signum
from zkit_example_plugin.watch import grad_norms

__version__ = "0.2.0"
__all__ = ["Signum", "grad_norms", "__version__"]
