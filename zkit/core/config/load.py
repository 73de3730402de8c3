""":func:`load_config`: a dict, a JSON file or a config in; a validated :class:`ZkitConfig` out."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

import attrs

from zkit.core.config.batch import GAS, MICRO, TB, resolve_batch
from zkit.core.config.errors import ConfigError
from zkit.core.config.fields import config_fields, is_section_type, type_options
from zkit.core.config.scalars import plain_scalars
from zkit.core.config.schema import ZkitConfig
from zkit.core.config.structure import Context, structure
from zkit.core.plugin_manager import builtin_config_providers, builtin_config_sections, builtin_section_owners
from zkit.core.records import ConfigSectionRecord, ProviderRecord


def load_config(
    source: Mapping[str, Any] | str | os.PathLike | ZkitConfig,
    *,
    world_size: int,
    sections: Mapping[str, ConfigSectionRecord] | None = None,
    providers: Mapping[str, ProviderRecord] | None = None,
) -> ZkitConfig:
    """Validate a DeepSpeed-style config for ``world_size`` data-parallel ranks.

    ``source`` is a dict, a path to a JSON file, or a :class:`ZkitConfig` (validated again for
    ``world_size``, e.g. after an elastic restart). ``sections`` maps dotted paths to the
    :class:`~zkit.core.records.ConfigSectionRecord` s of the plugins loaded, zkit's own included
    (``plugin_manager.config_sections()``); by default those of zkit's own plugins
    (``zero_optimization``...). ``providers`` maps dotted paths that no section may register to
    the :class:`~zkit.core.records.ProviderRecord` naming the distribution that provides them
    (``plugin_manager.config_providers()``); by default what zkit's own plugins declare. Raises :class:`ConfigError` for every bad input.
    """
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    records = dict(builtin_config_sections() if sections is None else sections)
    if isinstance(source, ZkitConfig):
        records = {**source.section_records, **records}
        data = copy.deepcopy(source.raw) if source.raw else source.to_dict()
    elif isinstance(source, (str, os.PathLike)):
        data = read_config_file(Path(source))
    elif isinstance(source, Mapping):
        data = plain_scalars(copy.deepcopy(dict(source)))
    else:
        raise ConfigError(
            "a config must be a dict, a path to a JSON file or a ZkitConfig, "
            f"got {type(source).__name__}"
        )
    _check_records(records)
    return _load(data, world_size, records, dict(builtin_config_providers() if providers is None else providers))


def read_config_file(path: Path) -> Any:
    """The JSON of the config file at ``path``, as :func:`load_config` reads it: a missing,
    unreadable, non-UTF-8 or invalid file, or a key given twice in one object, is a
    :class:`ConfigError` naming the file. For code that must look at a file's keys before handing
    them on (the DeepSpeed drop-in fills DeepSpeed's defaults)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from exc
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}"
        ) from None


def _refuse_duplicates(path: Path):
    """A JSON object hook that refuses a key given twice in one object (plain ``json`` keeps the
    last one silently: a file saying stage 3 and then stage 0 would run at stage 0), as DeepSpeed
    does."""

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(
                    f"config file '{path}': key '{key}' appears twice in one object "
                    f"(values {out[key]!r} and {value!r}); keep one"
                )
            out[key] = value
        return out

    return build


def _load(data: Any, world_size: int, records: dict[str, ConfigSectionRecord],
          providers: dict[str, ProviderRecord]) -> ZkitConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a JSON object, got {data!r}")
    raw = copy.deepcopy(data)
    replicas = world_size // _sequence_parallel_size(data.get(SP), world_size)
    tb, micro, gas = resolve_batch(data.get(TB), data.get(MICRO), data.get(GAS), replicas)
    data = {**data, TB: tb, MICRO: micro, GAS: gas}
    ctx = Context(sections=records, providers=providers, blocked={
        path: owner for path, owner in builtin_section_owners().items() if path not in records
    })
    config = structure(ZkitConfig, data, "", ctx)
    for path, record in records.items():
        parent = path.rpartition(".")[0]
        if record.default_when_absent and path not in ctx.found and (not parent or parent in ctx.found):
            ctx.found[path] = structure(record.schema, {}, path, ctx)
    return attrs.evolve(
        config,
        world_size=replicas,
        raw=raw,
        plugin_sections=ctx.found,
        section_records=records,
    )


#: DeepSpeed's key for the ranks that split one sequence: they are one data-parallel replica
SP = "sequence_parallel_size"


def _sequence_parallel_size(value: Any, world_size: int) -> int:
    """``sequence_parallel_size`` (default 1), which must divide the ``world_size`` ranks."""
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError.at(SP, f"must be an int >= 1, got {value!r}")
    if world_size % value:
        raise ConfigError.at(SP, f"{value} does not divide the {world_size} data-parallel ranks (the world, or the "
                                 f"data-parallel group of a model that brings its own: pipeline or tensor "
                                 f"parallelism): each sequence is split over {SP} ranks")
    return value


def builtin_section_paths(cls: type = ZkitConfig, path: str = "") -> dict[str, type]:
    """Dotted path -> class of every built-in section ("" is the top level)."""
    found = {path: attrs.resolve_types(cls)}  # annotations of ``from __future__`` modules are strings
    for f in config_fields(cls):
        for option in type_options(f.type):
            if is_section_type(option):
                found.update(builtin_section_paths(option, f"{path}.{f.name}" if path else f.name))
    return found


def section_paths(records: Mapping[str, ConfigSectionRecord] | None = None) -> dict[str, type]:
    """Dotted path -> class of every section: the kernel's, then those of ``records`` (by default
    zkit's own plugins') with the sections nested in them."""
    found = builtin_section_paths()
    for path, record in (builtin_config_sections() if records is None else records).items():
        found.update(builtin_section_paths(record.schema, path))
    return found


def _check_records(records: dict[str, Any]) -> None:
    builtin = builtin_section_paths()
    owners = builtin_section_owners()
    for path, record in list(records.items()):
        if not isinstance(record, ConfigSectionRecord):
            raise ConfigError(
                f"config section '{path}': expected a ConfigSectionRecord, got {record!r}"
            )
        who = f"registered by '{record.dist or 'unknown'}'"
        if record.path != path:
            raise ConfigError(
                f"config section '{path}' {who} names a different path, '{record.path}'"
            )
        if not (isinstance(record.schema, type) and attrs.has(record.schema)):
            raise ConfigError(
                f"config section '{path}' {who}: schema must be an attrs class, "
                f"got {record.schema!r}"
            )
        try:
            attrs.resolve_types(record.schema)
        except Exception as exc:  # a name in an annotation that cannot be resolved
            raise ConfigError(
                f"config section '{path}' {who}: cannot resolve its field types: {exc}"
            ) from exc
        parent, _, leaf = path.rpartition(".")
        if parent not in builtin and parent not in records:
            if parent in owners:  # under a section of a blocked built-in, which refuses its keys
                del records[path]
                continue
            raise ConfigError(f"config section '{path}' {who}: '{parent}' is not a config section")
        holder = builtin.get(parent) or records[parent].schema
        field = attrs.fields_dict(holder).get(leaf)
        if field is not None and not field.metadata.get("plugin_slot"):
            owner = "zkit" if parent in builtin else records[parent].dist or "unknown"
            raise ConfigError(f"config section '{path}' {who}: '{path}' is a built-in key of {owner}")
