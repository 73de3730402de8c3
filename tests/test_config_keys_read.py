"""Every config key is honoured or says it is not: a key of the schema (built-in and plugin
sections) either is read by the runtime code, or warns once that it has no effect (``hint``), or is
refused when set (``unimplemented``). A new key in none of these fails here."""
from __future__ import annotations

import re
from pathlib import Path

import attrs

from zkit.core.config.fields import config_fields, is_section_type, type_options
from zkit.core.config.load import section_paths
from zkit.core.plugin_manager import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]


def _runtime_source() -> str:
    """zkit's and the plugins' runtime code, less the config package that declares the keys."""
    files = [p for p in (ROOT / "zkit").rglob("*.py")  # less the files that declare the keys
             if "config" not in p.relative_to(ROOT / "zkit").parts[:-1] and p.name != "config.py"]
    for src in (ROOT / "plugins").glob("*/src"):
        files += list(src.rglob("*.py"))  # a plugin's config.py refuses what it cannot honour
    files += list((ROOT / "cuda_numba" / "src").rglob("*.py"))
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def _sections() -> dict[str, type]:
    found = dict(section_paths())
    for path, record in get_plugin_manager().config_sections().items():
        found[path] = record.schema
        for f in config_fields(attrs.resolve_types(record.schema)):
            for option in type_options(f.type):
                if is_section_type(option):
                    found[f"{path}.{f.name}"] = option
    return found


#: keys read under another name: ``gradient_accumulation_dtype`` is ``data_types.grad_accum_dtype``
#: (``ZkitConfig.grad_accum_dtype`` answers for both)
READ_AS = {"gradient_accumulation_dtype": "grad_accum_dtype"}


def _accounted(field: attrs.Attribute, source: str) -> bool:
    if field.metadata.get("hint") or field.metadata.get("unimplemented"):
        return True
    name = READ_AS.get(field.name, field.name)
    return re.search(rf"\.{name}\b|[\"']{name}[\"']", source) is not None


def test_every_key_is_read_warned_about_or_refused():
    source = _runtime_source()
    unaccounted = []
    for path, cls in _sections().items():
        fields = config_fields(attrs.resolve_types(cls))
        enabled = next((f for f in fields if f.name == "enabled"), None)
        if enabled is not None and enabled.metadata.get("unimplemented"):
            fields = [enabled]  # the section is refused as a whole when enabled
        for f in fields:
            if any(is_section_type(o) for o in type_options(f.type)):
                continue  # a section: its own keys are walked
            if not _accounted(f, source):
                unaccounted.append(f"{path}.{f.name}" if path else f.name)
    assert not unaccounted, (
        f"config keys neither read by the code, nor warned about (hint=), nor refused (unimplemented=): {unaccounted}"
    )
