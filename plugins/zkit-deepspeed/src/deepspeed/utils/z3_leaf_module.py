"""``deepspeed.utils.z3_leaf_module``: marking ZeRO-3 "leaf" modules.

DeepSpeed fetches a leaf module's whole subtree at once, for modules whose forward uses their
children's parameters in a data-dependent order (mixture-of-experts blocks). zkit gathers a
partitioned parameter when it is used, in whatever order, so the mark changes nothing in
zkit's gathering; it is kept (``module._z3_leaf``) with DeepSpeed's rules for code that sets
and reads it: classes match by type, by class name or by ``module.qualname``; finding no match
is a ``ValueError`` unless ``raise_if_not_found=False``.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Iterable

import torch

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is marked a leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed's ``ds_z3_leaf_module`` mark)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(model: torch.nn.Module, classes: Iterable[Any], flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(classes)
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of types or names, got {classes}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {model}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark the modules of the given classes as leaves; returns them."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Clear the mark of the modules of the given classes; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark modules by their ``named_modules()`` names; returns (marked, names not found)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in found:
        m._z3_leaf = flag
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {model}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark modules whose name ends with one of the suffixes; returns (marked, suffixes unmatched)."""
    named = list(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            m._z3_leaf = flag
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {model}")
    return list(found.values()), missing


class _CallableModule(types.ModuleType):
    """This module, callable as the function of its name. ``deepspeed.utils.z3_leaf_module`` is the
    function (as in DeepSpeed), but importing ``deepspeed.utils.z3_leaf_module`` for the first time
    under the drop-in's alias binds the module to that attribute; calling it then still works."""

    def __call__(self, model: torch.nn.Module) -> bool:
        return z3_leaf_module(model)


sys.modules[__name__].__class__ = _CallableModule
