"""What the forkserver of ``run_ranks`` imports once, so that every rank forked from it starts with it
(``conftest.py`` starts that forkserver with this module).

A rank would otherwise import these in each test, both ranks at once on the two cores: torch's
compiler front end (``torch._dynamo``, which the first ``torch.optim`` optimizer imports: ~2.5 s),
zkit's built-in and installed plugins (the first ``initialize`` imports them all: ~1-2 s) and
Numba's CUDA module (the cuda_numba plugin's first look: ~0.5 s). Only imports: none starts a
thread, and what they read from the environment at import (``NUMBA_*``) is set before the
forkserver starts and never changed for ranks by a test. A module that fails to import is left
for the rank to import, and fail on, as it would without this.
"""
from __future__ import annotations

import importlib
import importlib.metadata


def _try(load) -> None:
    try:
        load()
    except Exception:  # noqa: BLE001 - the rank imports it again and reports the error
        pass


_try(lambda: importlib.import_module("torch._dynamo"))
_try(lambda: importlib.import_module("pytest"))  # a rank re-imports the main module: pytest's, under `python -m pytest`


def _plugins() -> None:
    from zkit.core.plugin_manager import BUILTIN_PLUGINS, ENTRY_POINT_GROUP

    for _, module in BUILTIN_PLUGINS:
        _try(lambda: importlib.import_module(module))
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _try(ep.load)


_try(_plugins)
_try(lambda: importlib.import_module("numba.cuda"))
