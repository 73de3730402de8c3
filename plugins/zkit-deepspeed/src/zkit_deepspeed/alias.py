"""``deepspeed.X`` is ``zkit.compat.deepspeed.X``: one module object under two names.

``deepspeed/__init__.py`` calls :func:`install`, which puts :class:`AliasFinder` on
``sys.meta_path`` and makes ``sys.modules["deepspeed"]`` the ``zkit.compat.deepspeed`` package.
Sharing the module objects (rather than loading the files a second time under the new name)
keeps one copy of every module-level state: a ``zero.Init`` context, the communicator, and the
functions libraries patch (transformers replaces
``deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor``, for
instance) are seen by zkit's code as well.

A ``deepspeed.X`` that zkit does not provide is an ordinary ``ModuleNotFoundError``, so the
feature probes libraries run (``importlib.util.find_spec("deepspeed.ops.X")``, ``try: import``)
answer as they would on a DeepSpeed build without that extension. A module that zkit *refuses*
(``zkit.compat.deepspeed.refused.REFUSED_MODULES``: DeepSpeed-Inference, MoE internals, ...)
raises ``FeatureNotProvided`` at import instead, an ``ImportError`` whose message names the feature
and what to use; ``find_spec`` still answers None for it, so a probe does not take the feature
for present.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import attrs

#: the package that provides the ``deepspeed`` names
TARGET = "zkit.compat.deepspeed"
ALIAS = "deepspeed"


class AliasLoader(importlib.abc.Loader):
    """Loads ``<alias>.X`` by importing ``<target>.X`` and entering that module object under the
    alias (the import system returns what ``sys.modules`` holds after ``exec_module``, so the
    placeholder module it created is dropped)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder; exec_module replaces it

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class RefusingLoader(importlib.abc.Loader):
    """Raises the refusal of a module zkit does not provide, when it is imported."""

    def __init__(self, error: ImportError) -> None:
        self.error = error

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        raise self.error

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module raised
        raise self.error


def _called_by_find_spec() -> bool:
    """Whether ``importlib.util.find_spec`` (a feature probe) is asking, not an import."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _FIND_SPEC_CODE:
            return True
        frame = frame.f_back
    return False


_FIND_SPEC_CODE = importlib.util.find_spec.__code__


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``<alias>.X`` wherever ``<target>.X`` exists, and the modules the target refuses
    (``<target>.refused``); nothing else."""

    def __init__(self, alias: str = ALIAS, target: str = TARGET) -> None:
        self.alias, self.target = alias, target

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.alias + "."):
            return None
        real = self.target + fullname[len(self.alias):]
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:  # a parent is a module, not a package
            return None
        if spec is None:
            return self._refused(fullname)
        return importlib.util.spec_from_loader(
            fullname, AliasLoader(real), is_package=spec.submodule_search_locations is not None
        )


    def _refused(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        try:
            refused = importlib.import_module(self.target + ".refused")
        except ModuleNotFoundError:
            return None
        if refused.refusal_for(fullname) is None or _called_by_find_spec():
            return None
        return importlib.util.spec_from_loader(fullname, RefusingLoader(refused.refuse(fullname)))


def install(alias: str = ALIAS, target: str = TARGET) -> ModuleType:
    """Enter the finder (once per alias) and make ``sys.modules[alias]`` the ``target`` package."""
    try:
        package = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if not exc.name or not (target == exc.name or target.startswith(exc.name + ".")):
            raise  # something the target itself imports is missing: that error says what
        raise ImportError(
            f"the {alias} drop-in needs {target}, which this installation does not have ({exc}); "
            f"upgrade zkit, or `pip uninstall {alias}` to use a real DeepSpeed"
        ) from exc
    if not any(isinstance(f, AliasFinder) and f.alias == alias for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder(alias, target))
    sys.modules[alias] = package
    return package


@attrs.frozen
class ActiveDeepSpeed:
    """Which ``deepspeed`` an ``import deepspeed`` gives here."""

    kind: str  #: "zkit" (this drop-in), "real" (another distribution's files), or "missing"
    version: str | None  #: the ``deepspeed`` distribution's version, None when none is installed
    location: str | None  #: the ``deepspeed/__init__.py`` that an import runs

    def describe(self) -> str:
        if self.kind == "zkit":
            return (f"deepspeed {self.version} is zkit's drop-in ({TARGET}); "
                    "`pip uninstall deepspeed && pip install deepspeed` switches back to DeepSpeed")
        if self.kind == "real":
            return (f"deepspeed {self.version} from {self.location} is not zkit's drop-in: "
                    "`import deepspeed` runs that DeepSpeed, not zkit")
        return "deepspeed is not importable: the drop-in's files are missing (reinstall plugins/zkit-deepspeed)"


def _dropin_init() -> Path:
    return (Path(__file__).resolve().parent.parent / ALIAS / "__init__.py").resolve()


def active_deepspeed() -> ActiveDeepSpeed:
    """Answer without importing a real DeepSpeed (slow, and it may fail to import)."""
    try:
        version: str | None = importlib.metadata.version(ALIAS)
    except importlib.metadata.PackageNotFoundError:
        version = None
    loaded = sys.modules.get(ALIAS)
    if loaded is not None and getattr(loaded, "__name__", None) == TARGET:
        return ActiveDeepSpeed("zkit", version, str(_dropin_init()))
    if loaded is not None:
        return ActiveDeepSpeed("real", version, getattr(loaded, "__file__", None))
    spec = importlib.machinery.PathFinder.find_spec(ALIAS)
    if spec is None or spec.origin is None:
        return ActiveDeepSpeed("missing", version, None)
    origin = Path(spec.origin).resolve()
    return ActiveDeepSpeed("zkit" if origin == _dropin_init() else "real", version, str(origin))
