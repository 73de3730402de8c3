"""Which ``deepspeed`` an ``import deepspeed`` gives here: this drop-in, a real DeepSpeed found
first on the path, or none (``zkit report``'s ``deepspeed:`` line)."""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import sys
from pathlib import Path

import attrs

NAME = "deepspeed"


@attrs.frozen
class ActiveDeepSpeed:
    """Which ``deepspeed`` an ``import deepspeed`` gives here."""

    kind: str  #: "zkit" (this drop-in), "real" (another distribution's files), or "missing"
    version: str | None  #: the ``deepspeed`` distribution's version, None when none is installed
    location: str | None  #: the ``deepspeed/__init__.py`` that an import runs

    def describe(self) -> str:
        if self.kind == "zkit":
            return (f"deepspeed {self.version} is zkit's drop-in ({self.location}); "
                    "`pip uninstall deepspeed && pip install deepspeed` switches back to DeepSpeed")
        if self.kind == "real":
            return (f"deepspeed {self.version} from {self.location} is not zkit's drop-in: "
                    "`import deepspeed` runs that DeepSpeed, not zkit")
        return "deepspeed is not importable: the drop-in's files are missing (reinstall plugins/zkit-deepspeed)"


def dropin_init() -> Path:
    """The drop-in's ``deepspeed/__init__.py`` (beside this package)."""
    return (Path(__file__).resolve().parent.parent / NAME / "__init__.py").resolve()


def active_deepspeed() -> ActiveDeepSpeed:
    """Answer without importing a real DeepSpeed (slow, and it may fail to import)."""
    try:
        version: str | None = importlib.metadata.version(NAME)
    except importlib.metadata.PackageNotFoundError:
        version = None
    loaded = sys.modules.get(NAME)
    origin: str | None
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
    else:
        spec = importlib.machinery.PathFinder.find_spec(NAME)
        if spec is None or spec.origin is None:
            return ActiveDeepSpeed("missing", version, None)
        origin = spec.origin
    if origin is not None and Path(origin).resolve() == dropin_init():
        return ActiveDeepSpeed("zkit", version, str(dropin_init()))
    return ActiveDeepSpeed("real", version, origin)
