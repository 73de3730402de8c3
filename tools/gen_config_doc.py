"""Write docs/config.md from the config classes: python tools/gen_config_doc.py > docs/config.md

The tables come from the field declarations (type, default, range, documentation, notes), so the
reference cannot drift from the code.
"""
from __future__ import annotations

import inspect
import json
import sys
from typing import Any, TextIO

import attrs

from zkit.core.config.fields import config_fields, describe, is_section_type, type_options
from zkit.core.config.load import builtin_section_paths, section_paths
from zkit.core.plugin_manager import (
    BUILTIN_PLUGINS, builtin_config_providers, builtin_config_sections, builtin_section_owners,
)

INTRO = """\
# Configuration reference

zkit reads DeepSpeed's `ds_config.json` format: a dict or a JSON file with DeepSpeed's key
names, unchanged, for every key zkit supports.

```python
from zkit.core.config import load_config
cfg = load_config("ds_config.json", world_size=8, sections=pm.config_sections())
zero_config(cfg).stage, cfg.train_micro_batch_size_per_gpu, cfg.dtype  # zkit.zero.zero_config
```

The kernel (`zkit.core.config`) holds the batch sizes, precision, optimizer, scheduler and the
top-level scalars. Every other section belongs to the package that reads it: its plugin registers
the section (`zkit_config_sections`) and the package gives a typed accessor for it. With that
plugin blocked, its keys are an error naming the plugin to unblock.

Rules the loader applies to every section, including sections that plugins own:

* **Unknown keys are errors**, with the closest valid key:
  `unknown config key 'zero_optimization.stge'; did you mean 'zero_optimization.stage'?`
* **Types are strict JSON types**: `true` is not an int; `5e8` is accepted for an int key and
  stored as `500000000`; an int is accepted for a number key.
  `config key 'fp16.loss_scale_window' must be an int, got 'abc'`
* **Ranges are checked**: `config key 'zero_optimization.stage' must be between 0 and 3, got 5`
* **`"auto"` is rejected**: it is the Hugging Face Trainer's placeholder; resolve it before
  calling zkit.
* **Not implemented yet**: a few DeepSpeed keys are accepted with their defaults but raise
  `NotImplementedConfigError` when set to a value that asks for the feature (marked below).
* **Accepted, no effect**: performance switches that have no counterpart in zkit's design are
  accepted and ignored; the reason is given below.

## Batch size

`train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size`.
Any two determine the third. `train_batch_size` alone means 1 accumulation step and
`train_batch_size / world_size` per rank; `train_micro_batch_size_per_gpu` alone means 1
accumulation step. At least one of those two is required. With `sequence_parallel_size` above 1,
`world_size` is the data-parallel replicas, the world divided by it (the ranks that split one
sequence count once), as in DeepSpeed. Values that do not divide evenly are an
error (DeepSpeed floors them):
`train_batch_size 16 != train_micro_batch_size_per_gpu 3 * gradient_accumulation_steps 2 * world size 2 (= 12)`.

## Keys provided by other distributions

These keys are structured by the plugin that owns them when it is installed. Without it, only a
value that asks for nothing is accepted (`null`, or `{"device": "none"}` for the offload
sections); anything else is an error naming the distribution to install. The list is not the
kernel's: it is what zkit's built-in `zkit.distributions` declares (`zkit_register_providers`), and
any installed distribution may declare more.

| key | distribution |
|---|---|
"""

OLD_NAMES = """
## Old names

| old key | read as |
|---|---|
| `bfloat16` | `bf16` |
| `zero_optimization.stage3_gather_fp16_weights_on_model_save` | `zero_optimization.stage3_gather_16bit_weights_on_model_save` |
| `zero_optimization.cpu_offload: true` | `zero_optimization.offload_optimizer: {"device": "cpu"}` |
| `zero_optimization.cpu_offload_param: true` | `zero_optimization.offload_param: {"device": "cpu"}` |
| `zero_optimization.cpu_offload_use_pin_memory` | `pin_memory` of the two sections above |
"""


def _default(field: attrs.Attribute) -> str:
    if field.metadata.get("default_doc"):
        return f"`{field.metadata['default_doc']}`"
    if field.default is attrs.NOTHING:
        return "resolved"
    return f"`{json.dumps(field.default)}`"


def _notes(field: attrs.Attribute) -> str:
    parts = [field.metadata.get("doc", "")]
    checks = [c.__doc__ for c in field.metadata.get("checks", ()) if c.__doc__]
    if checks:
        parts.append("Allowed: " + "; ".join(checks) + ".")
    if field.metadata.get("hint"):
        parts.append(f"**Accepted, no effect**: {field.metadata['hint']}.")
    if field.metadata.get("unimplemented"):
        parts.append("**Not implemented yet** (any other value is an error).")
    return " ".join(p for p in parts if p).replace("|", "\\|")


def _table(cls: type, out: TextIO) -> None:
    out.write("| key | type | default | notes |\n|---|---|---|---|\n")
    for field in config_fields(cls):
        if any(is_section_type(o) for o in type_options(field.type)):
            kind = "section"
        else:
            kind = describe(field.type)
        out.write(f"| `{field.name}` | {kind} | {_default(field)} | {_notes(field)} |\n")


def write(out: TextIO) -> None:
    out.write(INTRO)
    for path, key in builtin_config_providers().items():
        out.write(f"| `{path}` | `{key.provider}` |\n")
    out.write(OLD_NAMES)
    kernel = builtin_section_paths()
    for path, cls in kernel.items():
        _section(path, cls, "", out)
    records = builtin_config_sections()
    owners = builtin_section_owners()
    modules = dict(BUILTIN_PLUGINS)
    out.write(PLUGIN_SECTIONS)
    for path, record in records.items():
        owner = owners[path]
        out.write(f"| `{path}` | `{owner}` | `{record.schema.__module__}` |\n")
    for path, cls in section_paths(records).items():
        if path in kernel:
            continue
        top = path.split(".")[0]
        where = f"Owned by zkit's plugin `{owners[top]}` (`{modules[owners[top]]}`)."
        _section(path, cls, where, out)


PLUGIN_SECTIONS = """
## Sections of zkit's own plugins

| key | plugin | schema |
|---|---|---|
"""


def _section(path: str, cls: type, where: str, out: TextIO) -> None:
    title = "Top level" if not path else f"`{path}`"
    doc = inspect.cleandoc(cls.__doc__ or "")
    out.write(f"\n## {title}\n\n{doc}{' ' + where if where else ''}\n\n")
    _table(cls, out)


def main(argv: list[str] | None = None) -> Any:
    write(sys.stdout)


if __name__ == "__main__":
    main()
