"""Consolidating a sharded checkpoint into one state dict that plain PyTorch loads.

    consolidate("ckpt", "model.safetensors", dtype="bf16")
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

    consolidate("ckpt", "model.pt")
    model.load_state_dict(torch.load("model.pt", weights_only=True))

The output holds every name ``model.state_dict()`` has: trainable parameters (assembled from the
pieces in the rank files), buffers and frozen parameters (from rank 0's ``module_extras``) and the
names under which tied tensors are reachable a second time (``aliases`` in the metadata).

Memory stays bounded by a chunk, not by the model or even its largest tensor: the layout of the output
file (every tensor's byte offset) is fixed first, then each saved piece is cast and written at its
offset, :data:`CHUNK_ELEMENTS` at a time. Rank files are memory-mapped and re-mapped after every
:data:`REMAP_BYTES` read from them, so their pages do not pile up in the resident set either.
``.safetensors`` output is written directly (the format is an 8-byte little-endian header length, a
JSON header, then the raw bytes); ``.pt``/``.bin`` output is a ``torch.save`` archive whose storage
records are laid out by ``torch.save`` under ``torch.serialization.skip_data`` and then filled in
place. Either file is written to a temporary and renamed, so a failure never leaves a partial file.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import torch

from zkit.checkpoint import formats
from zkit.checkpoint.digest import Digest, verify_tensor
from zkit.core.checkpoint_errors import CheckpointError
from zkit.checkpoint.files import META, rank_file
from zkit.checkpoint.piece_source import PieceSource
from zkit.core.plugin_manager import ZkitPluginManager

#: elements cast and written at a time (16 MiB of fp32): bounds the memory a consolidation needs.
CHUNK_ELEMENTS = 1 << 22
#: a rank file is re-mapped after this many bytes were read from it, which drops its resident pages.
REMAP_BYTES = 64 << 20

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TORCH_SUFFIXES = (".pt", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@attrs.frozen
class Consolidated:
    """What :func:`write_consolidated` wrote."""

    path: Path
    #: names in the state dict (tied aliases included).
    tensors: int
    #: distinct tensors (a tied weight counted once).
    distinct: int
    #: bytes of tensor data in the file (a tied weight twice in safetensors, which has no aliasing).
    nbytes: int
    #: the checkpoint directory (``<dir>/<tag>``) it was read from.
    source: Path
    dtype: str


@attrs.frozen
class PlannedTensor:
    """One tensor of the output: where its values come from and its output dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: the name it is saved under: a trainable parameter in the rank files' pieces, or a module extra.
    canonical: str
    is_param: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def consolidate(
    checkpoint_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: str | None = None,
    pm: ZkitPluginManager | None = None,
) -> Path:
    """Write the checkpoint at ``checkpoint_dir`` as one state dict at ``out_path``; return its path.

    ``checkpoint_dir`` is the directory given to ``engine.save_checkpoint`` (the tag comes from
    ``tag`` or its ``latest`` file) or one tag's directory. ``out_path`` ends in ``.pt`` or ``.bin``
    (a ``torch.load``-able archive) or ``.safetensors``. ``dtype`` ("fp32", the default, "fp16" or
    "bf16") is the dtype of every floating-point tensor written; integer buffers keep theirs.
    ``pm``: the plugin manager whose checkpoint formats read the checkpoint (default: a new one).
    """
    return write_consolidated(checkpoint_dir, out_path, tag=tag, dtype=dtype, pm=pm).path


def write_consolidated(
    checkpoint_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: str | None = None,
    pm: ZkitPluginManager | None = None,
) -> Consolidated:
    """:func:`consolidate`, returning what was written (tensor count, bytes)."""
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX):
        raise ValueError(f"{out} must end in .pt, .bin or .safetensors (got {out.suffix or 'no suffix'!r})")
    plan = plan_consolidation(checkpoint_dir, tag=tag, dtype=dtype, safetensors=suffix == SAFETENSORS_SUFFIX, pm=pm)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write_planned(plan, plan.entries, staging / out.name)
        os.replace(staging / out.name, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    distinct = {e.canonical: e for e in plan.entries}
    stored = plan.entries if suffix == SAFETENSORS_SUFFIX else distinct.values()  # .pt: aliases share storage
    return Consolidated(
        path=out,
        tensors=len(plan.entries),
        distinct=len(distinct),
        nbytes=sum(e.nbytes for e in stored),
        source=plan.where,
        dtype=plan.dtype,
    )


@attrs.frozen
class Plan:
    """What a consolidation writes (every tensor of the state dict, in order) and where each
    tensor's values are read from; nothing is read yet."""

    where: Path
    files: PieceSource
    sources: dict[str, list[tuple[str, int, int]]]
    entries: list[PlannedTensor]
    checksums: dict[str, dict[str, str]] | None
    dtype: str


def plan_consolidation(
    checkpoint_dir: str | os.PathLike[str], *, tag: str | None = None, dtype: str | None = None, safetensors: bool = True,
    pm: ZkitPluginManager | None = None,
) -> Plan:
    """Check the checkpoint (of any format providing ``pieces``: zkit's, DeepSpeed's with the drop-in)
    covers every tensor once; plan the output. ``pm``: the plugin manager whose checkpoint formats
    read it (default: a new one)."""
    dtype_name = "fp32" if dtype is None else dtype
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    if safetensors and sys.byteorder != "little":
        raise CheckpointError(
            f"safetensors output is little-endian; write a .pt file on this {sys.byteorder}-endian machine"
        )
    files = formats.open_pieces(pm, Path(checkpoint_dir), tag)
    where, meta = files.where, files.meta
    if "parts" in meta:
        raise CheckpointError(
            f"{where}: the checkpoint holds a model split into model-parallel parts ({', '.join(meta['parts'])}); "
            f"consolidate one part's directory, e.g. {where / meta['parts'][0]}"
        )
    sources = _piece_sources(meta, where)
    # Only the extras' shapes and dtypes now; their bytes are read (mapped again) when written.
    first = files.extras()
    extras = {name: (tuple(t.shape), t.dtype) for name, t in first.items()}
    del first
    return Plan(
        where=where, files=files, sources=sources, entries=_entries(meta, extras, DTYPES[dtype_name], where),
        checksums=meta.get("checksums") if meta.get("version", 1) >= 2 else None, dtype=dtype_name,
    )


def write_planned(plan: Plan, entries: list[PlannedTensor], path: Path) -> None:
    """Write ``entries`` (all of the plan's or a shard of them) to ``path``: safetensors or, for a
    ``.pt``/``.bin`` name, a torch archive. Damaged bytes are refused before anything is renamed
    into place by the caller."""
    if path.suffix.lower() == SAFETENSORS_SUFFIX:
        offsets = _safetensors_layout(path, entries)
    else:
        offsets = _torch_layout(path, entries)  # records are named after the file's base name
    _fill(path, entries, offsets, plan.sources, plan.files, plan.checksums)


def _piece_sources(meta: dict[str, Any], where: Path) -> dict[str, list[tuple[str, int, int]]]:
    """For every trainable parameter, the (file, start, end) ranges that hold it, checked to cover
    it exactly once - before anything is read or written."""
    meta_path = where / META
    shapes = meta.get("params")
    index = meta.get("index")
    if not isinstance(shapes, dict) or not isinstance(index, dict):
        raise CheckpointError(f"{meta_path}: metadata has no 'params' or 'index'")
    sources: dict[str, list[tuple[str, int, int]]] = {name: [] for name in shapes}
    for fname, ranges in index.items():
        if not (where / fname).is_file():
            raise CheckpointError(f"{where / fname}: checkpoint shard is missing")
        for name, start, end in ranges:
            if name not in sources:
                raise CheckpointError(f"{meta_path}: index lists {fname} as holding {name!r}, which is not a parameter")
            sources[name].append((fname, start, end))
    for name, ranges in sources.items():
        numel = math.prod(shapes[name])
        ranges.sort(key=lambda r: r[1])
        covered = 0
        for fname, start, end in ranges:
            if start > covered:
                break
            if start < covered:
                raise CheckpointError(
                    f"{meta_path}: elements [{start}, {min(end, covered)}) of parameter {name!r} are held twice "
                    f"({fname} and another file)"
                )
            covered = end
        if covered != numel:
            raise CheckpointError(
                f"{meta_path}: the rank files do not cover parameter {name!r} (shape {tuple(shapes[name])}, "
                f"{numel} elements): elements from {covered} on are missing or out of range"
            )
    return sources


def _entries(
    meta: dict[str, Any],
    extras: dict[str, tuple[tuple[int, ...], torch.dtype]],
    out_dtype: torch.dtype,
    where: Path,
) -> list[PlannedTensor]:
    """The output tensors in the model's ``state_dict()`` order (metadata order for checkpoints
    written before ``state_dict_keys`` was recorded)."""
    shapes = meta["params"]
    aliases: dict[str, str] = meta.get("aliases", {})
    keys = meta.get("state_dict_keys")
    if keys is None:  # older checkpoints: no aliases, every buffer
        keys = [*shapes, *(n for n in extras if n not in shapes)]

    def cast(dt: torch.dtype) -> torch.dtype:
        return out_dtype if dt.is_floating_point else dt

    entries = []
    for key in keys:
        canonical = aliases.get(key, key)
        if canonical in shapes:
            entries.append(PlannedTensor(key, tuple(shapes[canonical]), out_dtype, canonical, True))
        elif canonical in extras:
            shape, dt = extras[canonical]
            entries.append(PlannedTensor(key, shape, cast(dt), canonical, False))
        else:
            raise CheckpointError(
                f"{where}: state dict entry {key!r} is neither a saved parameter nor a buffer in {rank_file(0)}"
            )
    return entries


# -- output layouts: byte offset of every entry in the file ---------------------------------------

def _safetensors_layout(path: Path, entries: list[PlannedTensor]) -> dict[str, int]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e in entries:
        if e.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path.name}: {e.name!r} has dtype {e.dtype}, which safetensors cannot hold; write a .pt file"
            )
        header[e.name] = {
            "dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]
        }
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + pos)
    start = 8 + len(raw)
    return {e.name: start + header[e.name]["data_offsets"][0] for e in entries}


def _torch_layout(path: Path, entries: list[PlannedTensor]) -> dict[str, int]:
    """``torch.save`` a dict of placeholder tensors without their bytes; return where each
    storage record's bytes begin. Aliases share their canonical tensor's storage, as in a state
    dict saved from the model itself."""
    if not _torch_can_skip_data():
        raise CheckpointError(
            f"{path.name}: .pt/.bin output needs torch.serialization.skip_data(materialize_fake_tensors=...) "
            f"(torch >= 2.6, this is {torch.__version__}); write a .safetensors file instead"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode

    placeholders: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    with FakeTensorMode():
        for e in entries:
            if e.canonical not in placeholders:
                placeholders[e.canonical] = torch.empty(e.shape, dtype=e.dtype, device="cpu")
            state[e.name] = placeholders[e.canonical]
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)
    # torch.save numbers storages in the order it first meets them: dict order, aliases skipped.
    order = list(placeholders)
    by_canonical = {e.canonical: e for e in entries}
    records: dict[str, int] = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                key = int(parts[2])
                expected = by_canonical[order[key]].nbytes if key < len(order) else -1
                if info.file_size != expected:
                    raise RuntimeError(
                        f"torch.save laid out record {info.filename} with {info.file_size} bytes, expected "
                        f"{expected}: this torch's archive layout is not supported for streaming output"
                    )
                f.seek(info.header_offset)
                local = f.read(30)
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                records[order[key]] = info.header_offset + 30 + name_len + extra_len
    if len(records) != len(order):
        raise RuntimeError(f"torch.save wrote {len(records)} storage records for {len(order)} tensors")
    return {e.name: records[e.canonical] for e in entries}


def _torch_can_skip_data() -> bool:
    import inspect

    skip = getattr(torch.serialization, "skip_data", None)
    return skip is not None and "materialize_fake_tensors" in inspect.signature(skip).parameters


# -- filling ---------------------------------------------------------------------------------------

class _Shards:
    """Memory-mapped rank files, each opened when first needed, re-mapped after :data:`REMAP_BYTES`
    were read from it (its resident pages go with the old mapping) and closed after its last use.
    Callers hold a returned tensor only while writing one chunk, so a re-map does unmap."""

    def __init__(self, files: PieceSource, uses: Counter[str], checksums: dict[str, dict[str, str]] | None) -> None:
        self.files = files
        self.where = files.where
        self.checksums = checksums
        self.paths: dict[str, dict[tuple[str, int, int], str]] = {}
        self.left = uses
        self.open: dict[str, tuple[dict[tuple[str, int, int], torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.read: dict[str, int] = {}

    def _load(self, fname: str) -> tuple[dict[tuple[str, int, int], torch.Tensor], dict[str, torch.Tensor]]:
        if fname not in self.open:
            pieces = self.files.pieces(fname) if fname in self.files.meta["index"] else []
            extras = self.files.extras() if fname == self.files.extras_file else {}
            self.open[fname] = ({(p["name"], p["start"], p["end"]): p["master"] for p in pieces}, extras)
            self.paths[fname] = {(p["name"], p["start"], p["end"]): f"pieces/{i}/master" for i, p in enumerate(pieces)}
            self.read[fname] = 0
        return self.open[fname]

    def master(self, fname: str, name: str, start: int, end: int) -> torch.Tensor:
        """The saved fp32 values of ``name[start:end]``, flat."""
        master = self._load(fname)[0].get((name, start, end))
        path = self.where / fname
        if master is None:
            raise CheckpointError(
                f"{path}: holds no piece {name}[{start}:{end}] although {META} lists it "
                f"(are the rank files from another save?)"
            )
        if master.numel() != end - start:
            raise CheckpointError(
                f"{path}: piece {name}[{start}:{end}] is truncated ({master.numel()} of {end - start} elements)"
            )
        return master.reshape(-1)

    def extra(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter from rank 0's file, flat."""
        return self._load(self.files.extras_file)[1][name].reshape(-1)

    def digest(self) -> Digest | None:
        """A digest to feed one tensor's chunks to, or None for a checkpoint without checksums."""
        return Digest() if self.checksums is not None else None

    def verify(self, fname: str, key: tuple[str, int, int] | str, digest: Digest | None) -> None:
        """Refuse the piece ``key`` (or the extra named ``key``) of ``fname`` whose bytes were fed
        to ``digest`` unless they match the checksum saved with them."""
        if digest is None or self.checksums is None:
            return
        path = f"module_extras/{key}" if isinstance(key, str) else self.paths[fname][key]
        verify_tensor(digest, path, self.checksums.get(fname, {}), self.where / fname)

    def consumed(self, fname: str, nbytes: int) -> None:
        self.read[fname] += nbytes
        if self.read[fname] >= REMAP_BYTES:
            del self.open[fname]

    def done(self, fname: str) -> None:
        self.left[fname] -= 1
        if self.left[fname] == 0:
            self.open.pop(fname, None)


def _fill(
    path: Path,
    entries: list[PlannedTensor],
    offsets: dict[str, int],
    sources: dict[str, list[tuple[str, int, int]]],
    files: PieceSource,
    checksums: dict[str, dict[str, str]] | None,
) -> None:
    # An alias sharing its canonical tensor's storage (.pt) has its offset: written once.
    writes = list({(offsets[e.name], e.canonical): e for e in entries}.values())
    uses = Counter(f for e in writes if e.is_param for f, _, _ in sources[e.canonical])
    uses[files.extras_file] += sum(not e.is_param for e in writes)
    shards = _Shards(files, uses, checksums)
    fd = os.open(path, os.O_WRONLY)
    try:
        for e in writes:
            offset, size = offsets[e.name], e.dtype.itemsize
            ranges = sources[e.canonical] if e.is_param else [(files.extras_file, 0, e.numel)]
            for fname, start, end in ranges:
                digest = shards.digest()  # fed the saved bytes as they stream past
                for lo in range(start, end, CHUNK_ELEMENTS):
                    hi = min(lo + CHUNK_ELEMENTS, end)
                    flat = shards.master(fname, e.canonical, start, end) if e.is_param else shards.extra(e.canonical)
                    saved = flat[lo - start : hi - start]
                    if digest is not None:
                        digest.update(saved)
                    chunk = saved.to(e.dtype).contiguous()
                    read = (hi - lo) * flat.element_size()
                    del flat, saved
                    _pwrite_all(fd, chunk, offset + lo * size)
                    del chunk  # may be a view of the mapping: gone before a re-map
                    shards.consumed(fname, read)
                shards.verify(fname, (e.canonical, start, end) if e.is_param else e.canonical, digest)
                shards.done(fname)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, values: torch.Tensor, offset: int) -> None:
    view = memoryview(values.view(torch.uint8).numpy())
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
