"""A per-engine store for plugin state, modelled on pytest's ``Stash``.

A plugin that keeps state for one engine (a pipeline's runner, a cached table of weights) puts it
in ``engine.stash`` under a key it owns, instead of setting attributes on the engine::

    from zkit.core.stash import StashKey

    RUNNER = StashKey[PipelineRunner]()

    @zkit.hookimpl
    def zkit_engine_setup(engine):
        engine.stash[RUNNER] = PipelineRunner(...)

    runner = engine.stash[RUNNER]               # KeyError when never set
    runner = engine.stash.get(RUNNER, None)

Keys are compared by identity, so two plugins never collide, and a type checker knows the type of
each value from its key.
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar, Union, cast

T = TypeVar("T")
D = TypeVar("D")


class StashKey(Generic[T]):
    """A key of a :class:`Stash`; ``StashKey[int]()`` keys an ``int``. Create one per kind of
    state, at module level."""

    __slots__ = ()


class Stash:
    """Values keyed by :class:`StashKey` objects (a typed, per-object dict)."""

    __slots__ = ("_storage",)

    def __init__(self) -> None:
        self._storage: dict[StashKey[Any], object] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._storage[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return cast(T, self._storage[key])

    def get(self, key: StashKey[T], default: D) -> Union[T, D]:
        try:
            return self[key]
        except KeyError:
            return default

    def setdefault(self, key: StashKey[T], default: T) -> T:
        """The value of ``key``; ``default`` (stored) when it has none."""
        try:
            return self[key]
        except KeyError:
            self[key] = default
            return default

    def __delitem__(self, key: StashKey[T]) -> None:
        del self._storage[key]

    def __contains__(self, key: StashKey[T]) -> bool:
        return key in self._storage

    def __len__(self) -> int:
        return len(self._storage)
