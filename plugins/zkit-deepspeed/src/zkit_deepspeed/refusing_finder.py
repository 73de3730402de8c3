"""Imports of the ``deepspeed.X`` modules zkit *refuses* raise :class:`FeatureNotProvided`.

``deepspeed`` is an ordinary package of this distribution, so a ``deepspeed.X`` that zkit does not
provide is an ordinary ``ModuleNotFoundError``: the feature probes libraries run
(``importlib.util.find_spec("deepspeed.ops.X")``, ``try: import``) answer as they would on a
DeepSpeed build without that extension. A module that zkit refuses
(``deepspeed.refused.REFUSED_MODULES``: DeepSpeed-Inference, MoE internals, ...) raises
``FeatureNotProvided`` at import instead, an ``ImportError`` whose message names the feature and
what to use; ``find_spec`` still answers None for it, so a probe does not take the feature for
present. :class:`RefusingFinder` does that; it sits at the end of ``sys.meta_path``, so it is
asked only about names no other finder has.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from deepspeed.refused import refusal_for, refuse


class RefusingLoader(importlib.abc.Loader):
    """Raises the refusal of a module zkit does not provide, when it is imported."""

    def __init__(self, error: ImportError) -> None:
        self.error = error

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        raise self.error

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module raised
        raise self.error


_FIND_SPEC_CODE = importlib.util.find_spec.__code__


def _called_by_find_spec() -> bool:
    """Whether ``importlib.util.find_spec`` (a feature probe) is asking, not an import."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _FIND_SPEC_CODE:
            return True
        frame = frame.f_back
    return False


class RefusingFinder(importlib.abc.MetaPathFinder):
    """Finds the ``deepspeed.X`` modules zkit refuses, for an import only; nothing else."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("deepspeed.") or refusal_for(fullname) is None or _called_by_find_spec():
            return None
        return importlib.util.spec_from_loader(fullname, RefusingLoader(refuse(fullname)))


def install() -> None:
    """Append the finder to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, RefusingFinder) for f in sys.meta_path):
        sys.meta_path.append(RefusingFinder())
