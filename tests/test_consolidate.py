"""Consolidation: a sharded checkpoint becomes one state dict that plain PyTorch loads."""
from __future__ import annotations

import importlib
import json
import math
import shutil
import struct
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import zkit
from zkit.checkpoint import CheckpointError
from zkit.checkpoint.consolidate import consolidate, write_consolidated
from zkit.checkpoint.files import FORMAT, VERSION, write_meta
from zkit.checkpoint.save import tensor_aliases
from zkit.cli import main as cli_main
from zkit.testing import run_ranks

import engine_ranks as er

consolidate_module = importlib.import_module("zkit.checkpoint.consolidate")


class TiedHeadNet(torch.nn.Module):
    """An output head tied to the embedding by attribute (a second name for one Parameter), a frozen
    parameter, persistent float and integer buffers and a non-persistent buffer."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.shift = torch.nn.Parameter(torch.randn(dim), requires_grad=False)
        self.register_buffer("scale", torch.full((dim,), 0.5))
        self.register_buffer("calls", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("cache", torch.ones(4), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(ids))) * self.scale + self.shift
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def make_model(seed: int = 0) -> TiedHeadNet:
    torch.manual_seed(seed)
    return TiedHeadNet()


def train_and_save(path: str) -> dict[str, torch.Tensor]:
    """Rank function: 2 steps at stage 2, save; the engine's state dict to compare with."""
    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=make_model(), config=er.config(2, "fp32", 1, world))
    er.train_engine(engine, 2, 1, world)
    engine.save_checkpoint(path, tag="step2")
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank stage-2 checkpoint (the parameters are split across both rank files) and the
    trained state dict."""
    root = tmp_path_factory.mktemp("consolidate") / "ckpt"
    states = run_ranks(train_and_save, 2, args=(str(root),), timeout=300)
    return root, states[0]


@pytest.fixture
def ckpt(trained, tmp_path):
    """A private copy, for tests that damage it."""
    root, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    return copy


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """An independent reader of the documented format, so the tests need no safetensors package."""
    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    data = raw[8 + n :]
    out, ends = {}, []
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        ends.append((lo, hi))
        dtype = names[info["dtype"]]
        out[name] = torch.frombuffer(bytearray(data[lo:hi]), dtype=dtype).reshape(info["shape"]) if hi > lo else (
            torch.empty(info["shape"], dtype=dtype))
    ends.sort()
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] == len(data)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        expected = value.to(dtype) if value.is_floating_point() else value
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


# -- output formats ---------------------------------------------------------------------------------

def test_pt_output_loads_into_a_plain_model(trained, tmp_path):
    root, engine_state = trained
    out = consolidate(root, tmp_path / "model.pt")
    assert out == tmp_path / "model.pt"
    state = torch.load(out, weights_only=True)
    assert_same(state, engine_state)
    assert "head.weight" in state and "cache" not in state
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # tied, stored once
    model = make_model(seed=5)
    model.load_state_dict(state)  # strict
    assert_same(model.state_dict(), engine_state)
    assert model.head.weight is model.embed.weight
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporaries left


def test_safetensors_output_is_the_documented_format(trained, tmp_path):
    root, engine_state = trained
    out = consolidate(root, tmp_path / "model.safetensors", tag="step2")
    state = read_safetensors(out)
    assert_same(dict(sorted(state.items())), dict(sorted(engine_state.items())))
    make_model(seed=5).load_state_dict(state)
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    assert_same(dict(sorted(load_file(out).items())), dict(sorted(engine_state.items())))


@pytest.mark.parametrize("dtype,suffix", [("fp16", ".pt"), ("bf16", ".safetensors"), ("fp16", ".safetensors")])
def test_half_precision_output_casts_floats_and_keeps_integers(trained, tmp_path, dtype, suffix):
    root, engine_state = trained
    out = consolidate(root, tmp_path / f"model{suffix}", dtype=dtype)
    state = torch.load(out, weights_only=True) if suffix == ".pt" else read_safetensors(out)
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert_same(dict(sorted(state.items())), dict(sorted(engine_state.items())), want)
    assert state["calls"].dtype == torch.int64
    expected = sum(v.numel() * (want.itemsize if v.is_floating_point() else v.element_size())
                   for k, v in engine_state.items() if suffix == ".safetensors" or k != "head.weight")  # .pt: tied once
    assert write_consolidated(root, tmp_path / f"again{suffix}", dtype=dtype).nbytes == expected


def test_tiny_chunks_and_remapping_give_the_same_file(trained, tmp_path, monkeypatch):
    root, _ = trained
    whole = consolidate(root, tmp_path / "whole.safetensors").read_bytes()
    monkeypatch.setattr(consolidate_module, "CHUNK_ELEMENTS", 5)
    monkeypatch.setattr(consolidate_module, "REMAP_BYTES", 64)
    assert consolidate(root, tmp_path / "chunked.safetensors").read_bytes() == whole
    chunked = torch.load(consolidate(root, tmp_path / "chunked.pt"), weights_only=True)
    assert_same(chunked, torch.load(consolidate(root, tmp_path / "whole.pt"), weights_only=True))


def test_a_tag_directory_and_an_in_process_stage0_checkpoint(tmp_path):
    model = make_model(seed=3)
    engine = zkit.initialize(model=model, config=er.config(0, "fp32", 1, 1))[0]
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    state = torch.load(consolidate(tmp_path / "ckpt" / "t", tmp_path / "m.bin"), weights_only=True)
    assert_same(state, engine.module.state_dict())


# -- metadata the consolidation needs ------------------------------------------------------------

def test_save_records_aliases_and_state_dict_keys(trained):
    root, engine_state = trained
    meta = msgpack.unpackb((root / "step2" / "meta.msgpack").read_bytes(), strict_map_key=False)
    assert meta["aliases"] == {"head.weight": "embed.weight"}
    assert meta["state_dict_keys"] == list(engine_state)
    assert sorted(meta["index"]) == ["rank_00000.pt", "rank_00001.pt"]


def test_tensor_aliases_covers_parameters_and_buffers():
    model = TiedHeadNet()
    model.mirror = torch.nn.Module()
    model.mirror.register_buffer("scale_again", model.scale)
    model.mirror.head = model.head  # a whole module reachable twice
    assert tensor_aliases(model) == {
        "head.weight": "embed.weight",
        "mirror.head.weight": "embed.weight",
        "mirror.scale_again": "scale",
    }


def test_checkpoint_without_alias_metadata_gives_params_then_every_buffer(ckpt, tmp_path):
    meta_path = ckpt / "step2" / "meta.msgpack"
    meta = msgpack.unpackb(meta_path.read_bytes(), strict_map_key=False)
    del meta["aliases"], meta["state_dict_keys"]
    write_meta(meta_path, meta)
    state = torch.load(consolidate(ckpt, tmp_path / "m.pt"), weights_only=True)
    assert list(state) == [*meta["params"], "scale", "calls", "cache", "shift"]


# -- hypothesis: any cut of parameters into pieces across files assembles back --------------------

def write_synthetic(
    root: Path, params: dict[str, torch.Tensor], cuts: dict[str, list[int]], files: int, extras: object = None
) -> None:
    """A checkpoint whose pieces cut each parameter at ``cuts`` and go to files round-robin."""
    where = root / "t"
    where.mkdir(parents=True)
    pieces: list[list[dict]] = [[] for _ in range(files)]
    index: dict[str, list] = {f"rank_{r:05d}.pt": [] for r in range(files)}
    k = 0
    for name, value in params.items():
        bounds = [0, *cuts[name], value.numel()]
        for start, end in zip(bounds, bounds[1:]):
            r = k % files
            k += 1
            pieces[r].append({"name": name, "start": start, "end": end, "master": value.reshape(-1)[start:end].clone(), "state": {}})
            index[f"rank_{r:05d}.pt"].append([name, start, end])
    for r in range(files):
        payload = {"pieces": pieces[r], **({"module_extras": extras or {}} if r == 0 else {})}
        torch.save(payload, where / f"rank_{r:05d}.pt")
    write_meta(where / "meta.msgpack", {
        "format": FORMAT, "version": VERSION, "params": {n: list(v.shape) for n, v in params.items()},
        "index": index, "state_dict_keys": [*params, *(extras if isinstance(extras, dict) else ())], "aliases": {},
    })


@st.composite
def sharded_params(draw):
    shapes = draw(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=4))
    params, cuts = {}, {}
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        params[f"p{i}"] = torch.arange(numel, dtype=torch.float32).reshape(shape) + 100 * i
        cuts[f"p{i}"] = sorted(draw(st.sets(st.integers(1, max(numel - 1, 1)), max_size=4) if numel > 1 else st.just(set())))
    return params, cuts, draw(st.integers(1, 3)), draw(st.integers(1, 7))


@settings(max_examples=25, deadline=None)
@given(sharded_params())
def test_any_piece_layout_assembles_to_the_original(tmp_path_factory, case):
    params, cuts, files, chunk = case
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic(root, params, cuts, files)
    old = consolidate_module.CHUNK_ELEMENTS
    consolidate_module.CHUNK_ELEMENTS = chunk  # chunk boundaries anywhere inside a piece
    try:
        st_out = read_safetensors(consolidate(root, root / "m.safetensors", tag="t"))
        pt_out = torch.load(consolidate(root, root / "m.pt", tag="t"), weights_only=True)
    finally:
        consolidate_module.CHUNK_ELEMENTS = old
    assert_same(st_out, params)
    assert_same(pt_out, params)


# -- errors name the file and the problem --------------------------------------------------------

def edit_meta(ckpt: Path, change) -> None:
    path = ckpt / "step2" / "meta.msgpack"
    meta = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
    change(meta)
    write_meta(path, meta)


def test_truncated_rank_file_names_it(ckpt, tmp_path):
    shard = ckpt / "step2" / "rank_00001.pt"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: cannot read checkpoint shard"):
        consolidate(ckpt, tmp_path / "m.pt")
    assert list(tmp_path.glob("*m.pt*")) == []  # neither the output nor a temporary


def test_missing_rank_file_names_it(ckpt, tmp_path):
    (ckpt / "step2" / "rank_00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: checkpoint shard is missing"):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_truncated_piece_names_the_file_and_piece(ckpt, tmp_path):
    shard = ckpt / "step2" / "rank_00000.pt"
    data = torch.load(shard, weights_only=True)
    piece = data["pieces"][0]
    piece["master"] = piece["master"].reshape(-1)[:-1].clone()
    torch.save(data, shard)
    name, start, end = piece["name"], piece["start"], piece["end"]
    with pytest.raises(CheckpointError, match=rf"rank_00000\.pt: piece {name}\[{start}:{end}\] is truncated"):
        consolidate(ckpt, tmp_path / "m.pt")
    assert list(tmp_path.glob("*m.pt*")) == []


def test_rank_file_from_another_save_is_refused(ckpt, tmp_path):
    def move_a_piece(meta):  # rank 1 is said to hold a piece rank 0 holds
        meta["index"]["rank_00001.pt"].append(meta["index"]["rank_00000.pt"].pop())
    edit_meta(ckpt, move_a_piece)
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: holds no piece .* although meta\.msgpack lists it"):
        consolidate(ckpt, tmp_path / "m.pt")


def test_uncovered_and_doubly_covered_parameters_are_refused(ckpt, tmp_path):
    edit_meta(ckpt, lambda meta: meta["index"]["rank_00001.pt"].pop())
    with pytest.raises(CheckpointError, match=r"meta\.msgpack: the rank files do not cover parameter '[\w.]+'"):
        consolidate(ckpt, tmp_path / "m.pt")
    edit_meta(ckpt, lambda meta: meta["index"]["rank_00001.pt"].extend(meta["index"]["rank_00000.pt"]))
    with pytest.raises(CheckpointError, match=r"of parameter '[\w.]+' are held twice"):
        consolidate(ckpt, tmp_path / "m.pt")


def test_unknown_names_in_metadata_are_refused(ckpt, tmp_path):
    edit_meta(ckpt, lambda meta: meta["state_dict_keys"].append("ghost.weight"))
    with pytest.raises(CheckpointError, match=r"state dict entry 'ghost\.weight' is neither a saved parameter nor a buffer"):
        consolidate(ckpt, tmp_path / "m.pt")
    edit_meta(ckpt, lambda meta: meta["index"]["rank_00000.pt"].append(["ghost.bias", 0, 1]))
    with pytest.raises(CheckpointError, match=r"lists rank_00000\.pt as holding 'ghost\.bias', which is not a parameter"):
        consolidate(ckpt, tmp_path / "m.pt")


def test_malformed_files_are_refused(tmp_path):
    params = {"w": torch.ones(2, 3)}
    write_synthetic(tmp_path / "a", params, {"w": [2]}, 2, extras=[torch.ones(1)])
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: 'module_extras' is not a dict of tensors"):
        consolidate(tmp_path / "a", tmp_path / "a.pt", tag="t")
    write_synthetic(tmp_path / "b", params, {"w": [2]}, 2)
    torch.save({"rng": {}}, tmp_path / "b" / "t" / "rank_00001.pt")
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: checkpoint shard has no 'pieces' list"):
        consolidate(tmp_path / "b", tmp_path / "b.pt", tag="t")
    write_synthetic(tmp_path / "c", params, {"w": []}, 1)
    meta = msgpack.unpackb((tmp_path / "c" / "t" / "meta.msgpack").read_bytes())
    del meta["index"]
    write_meta(tmp_path / "c" / "t" / "meta.msgpack", meta)
    with pytest.raises(CheckpointError, match=r"meta\.msgpack: metadata has no 'params' or 'index'"):
        consolidate(tmp_path / "c", tmp_path / "c.pt", tag="t")


def test_dtypes_safetensors_cannot_hold_are_refused_and_pt_keeps_them(tmp_path):
    spectrum = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    write_synthetic(tmp_path, {"w": torch.ones(3)}, {"w": []}, 1, extras={"spectrum": spectrum})
    with pytest.raises(CheckpointError, match=r"m\.safetensors: 'spectrum' has dtype torch\.complex64, which safetensors cannot hold"):
        consolidate(tmp_path, tmp_path / "m.safetensors", tag="t", dtype="bf16")
    state = torch.load(consolidate(tmp_path, tmp_path / "m.pt", tag="t", dtype="bf16"), weights_only=True)
    assert torch.equal(state["spectrum"], spectrum) and state["w"].dtype == torch.bfloat16


def test_bad_arguments_are_refused(trained, tmp_path):
    root, _ = trained
    with pytest.raises(ValueError, match=r"must end in \.pt, \.bin or \.safetensors \(got '\.ckpt'\)"):
        consolidate(root, tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match=r"dtype must be one of fp32, fp16, bf16, got 'fp8'"):
        consolidate(root, tmp_path / "m.pt", dtype="fp8")
    with pytest.raises(CheckpointError, match=r"latest: no 'latest' file; pass tag="):
        consolidate(tmp_path, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="no checkpoint metadata"):
        consolidate(root, tmp_path / "m.pt", tag="step9")


def test_environment_limits_are_explained(trained, tmp_path, monkeypatch):
    root, _ = trained
    monkeypatch.delattr(torch.serialization, "skip_data")
    with pytest.raises(CheckpointError, match=r"\.pt/\.bin output needs torch\.serialization\.skip_data.*write a \.safetensors"):
        consolidate(root, tmp_path / "m.pt", tag="step2")
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(CheckpointError, match="safetensors output is little-endian"):
        consolidate(root, tmp_path / "m.safetensors", tag="step2")


# -- command line -----------------------------------------------------------------------------------

def test_cli_writes_and_reports(trained, tmp_path, capsys):
    root, engine_state = trained
    out = tmp_path / "model.bin"
    assert cli_main(["consolidate", str(root), str(out), "--tag", "step2", "--dtype", "bf16"]) == 0
    printed = capsys.readouterr().out
    nbytes = sum(v.numel() * (2 if v.is_floating_point() else v.element_size())
                 for k, v in engine_state.items() if k != "head.weight")  # tied: stored once
    assert f"wrote {out}: {len(engine_state)} tensors (1 tied aliases), {nbytes:,} bytes of tensor data (bf16)" in printed
    assert_same(torch.load(out, weights_only=True), engine_state, torch.bfloat16)


def test_cli_errors_are_one_line(trained, tmp_path, capsys):
    root, _ = trained
    with pytest.raises(SystemExit, match=r"^zkit consolidate: .*step9/meta\.msgpack: no checkpoint metadata"):
        cli_main(["consolidate", str(root), str(tmp_path / "m.pt"), "--tag", "step9"])
    with pytest.raises(SystemExit):
        cli_main(["consolidate", str(root), str(tmp_path / "m.pt"), "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
