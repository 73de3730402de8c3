"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base of DeepSpeed's
config classes, with DeepSpeed's rules, for code that defines its own config sections on it.

The rules: unknown keys are errors (``extra="forbid"``), a field may be given by its name or its
alias, assignments are validated, ``"auto"`` values are dropped unless ``strict=True`` (Hugging
Face fills them in later), and a field marked deprecated in ``json_schema_extra``
(``{"deprecated": True, "new_param": "x", "new_param_fn": f, "set_new_param": True,
"deprecated_msg": "..."}``) moves its value to ``new_param`` with a warning. zkit's own config is
:mod:`zkit.core.config` (frozen attrs classes); this module needs pydantic 2.
"""
from __future__ import annotations

from functools import reduce
from typing import Any

try:
    from pydantic import BaseModel, ConfigDict
except ImportError as exc:  # pragma: no cover - pydantic comes with transformers and accelerate
    raise ImportError(f"deepspeed.runtime.config_utils needs pydantic 2 (pip install pydantic): {exc}") from exc

from deepspeed.utils import logger

__all__ = ["DeepSpeedConfigModel", "get_config_default", "pp_int"]


class DeepSpeedConfigModel(BaseModel):
    """A pydantic model with DeepSpeed's config rules (see the module docstring)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if v != "auto" or k == "replace_method"}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict) -> None:
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new} instead" if new else "")
                       + (f". {note}" if note else ""))
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        delattr(self, name)
        *path, leaf = new.split(".")
        owner = reduce(getattr, path, self)
        if leaf in owner.model_fields_set:  # an AssertionError, as DeepSpeed's (its tests expect that type)
            raise AssertionError(f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new}' "
                                 f"together")
        setattr(owner, leaf, value)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """The default of ``config``'s field ``field_name`` (which must have one)."""
    fields = config.model_fields
    if field_name not in fields:
        raise ValueError(f"'{field_name}' is not a field in {config}")
    if fields[field_name].is_required():
        raise ValueError(f"'{field_name}' is a required field and does not have a default value")
    return fields[field_name].get_default()


class pp_int(int):  # noqa: N801 - DeepSpeed's name
    """An int that prints with thousands separators (or a given text), for generated docs."""

    def __new__(cls, value: float, custom_print_str: str | None = None) -> "pp_int":
        inst = super().__new__(cls, value)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{self.real:,}"
