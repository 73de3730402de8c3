"""The types of the coverage inventory (:mod:`zkit_deepspeed.coverage`)."""
from __future__ import annotations

import enum

import attrs


class Status(enum.Enum):
    PROVIDED = "provided"  #: resolves, with DeepSpeed's behaviour
    REFUSED = "refused"  #: resolving it raises FeatureNotProvided naming the feature and the alternative
    #: planned, not yet provided: resolves once it is, absent until then
    PENDING = "pending"


@attrs.frozen
class Entry:
    name: str  #: the dotted name as code writes it (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``)
    status: Status
    sources: tuple[str, ...]  #: keys of :data:`SOURCES`
    note: str = ""  #: where the behaviour differs from DeepSpeed's, briefly


def _e(name: str, sources: str, note: str = "", status: Status = Status.PROVIDED) -> Entry:
    return Entry(name, status, tuple(sources.split()), note)


def _r(name: str, sources: str, note: str = "") -> Entry:
    return _e(name, sources, note, Status.REFUSED)


def _p(name: str, sources: str, note: str = "") -> Entry:
    return _e(name, sources, note, Status.PENDING)
