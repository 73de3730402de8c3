"""``deepspeed.utils.module_utils``: reach a submodule (or any attribute) of a model by its dotted
name, as ``model.named_modules()`` writes it. DeepSpeed-Chat's LoRA conversion replaces
``nn.Linear`` layers with them."""
from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name == "a.b.c"``; ``AttributeError`` where a part is missing."""
    found = model
    for part in module_name.split("."):
        found = getattr(found, part)
    return found


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name == "a.b.c"`` (through the parent's
    ``__setattr__``, so an ``nn.Module`` parent registers a module or parameter)."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    parent.__setattr__(leaf, module)
