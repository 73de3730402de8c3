"""The distributions zkit ships apart, and what each provides: a built-in plugin answering
:func:`zkit.core.hookspecs.zkit_register_providers`, so that a name, a config key or a hook's
answer asked for without its distribution installed is an error saying what to install.

A distribution that is not installed can declare nothing, so this list is what the ``zkit``
distribution knows of its sister distributions; the kernel knows none of them. Once a
distribution is installed, its own records answer (whoever provides a name then, this list is
not asked). Another family of plugins declares its own optional distributions the same way,
from a distribution of it that is installed.
"""
from __future__ import annotations

from typing import Any, Iterator

from zkit.core.hookspecs import hookimpl
from zkit.core.records import ProviderRecord


def _no_offload(value: Any) -> bool:
    """An offload section that offloads nothing (``null``, or ``device`` ``"none"``)."""
    return value is None or (isinstance(value, dict) and str(value.get("device") or "none").lower() == "none")


#: distribution -> {kind: the names it provides}
PROVIDED: dict[str, dict[str, tuple[str, ...]]] = {
    "zkit-onebit": {"optimizer": ("onebitadam",), "communicator": ("onebit",)},
    "zkit-offload": {"optimizer": ("cpu_adam", "cpu_adamw"), "allocator": ("host", "nvme"),
                     "config": ("zero_optimization.offload_optimizer", "zero_optimization.offload_param", "aio")},
    "zkit-sparse": {"attention": ("block_sparse",), "config": ("sparse_attention",)},
    "zkit-sequence": {"attention": ("ulysses",), "hook": ("zkit_sequence_parallel",)},
    "zkit-pipeline": {"scheduler": ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1"), "config": ("pipeline",)},
}

#: config keys whose values ask for nothing in more ways than ``null``
_INERT = {"zero_optimization.offload_optimizer": _no_offload, "zero_optimization.offload_param": _no_offload}


@hookimpl
def zkit_register_providers() -> Iterator[ProviderRecord]:
    for provider, kinds in PROVIDED.items():
        for kind, names in kinds.items():
            for name in names:
                extra = {"inert": _INERT[name]} if name in _INERT else {}
                yield ProviderRecord(kind=kind, name=name, provider=provider, **extra)
