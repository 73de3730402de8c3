"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section's model
(which modules ZeRO-3 treats as leaves: by class path, module name or name suffix)."""
from __future__ import annotations

from typing import Any, List

from pydantic import Field, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

#: the mixture-of-experts blocks DeepSpeed marks as leaves unless told otherwise
DEFAULT_LEAF_MODULE_CLASSES: List[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: List[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: List[str] = []


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """``classes``, ``names``, ``name_suffixes``: lists (a single string is a list of one),
    duplicates dropped in order."""

    classes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values: Any) -> Any:
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError("leaf_module configuration must be a mapping of fields to values")
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in values.items()}

    @model_validator(mode="after")
    def _unique(self) -> "DeepSpeedZeroLeafModuleConfig":
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(str(v) for v in getattr(self, key))))
        return self
