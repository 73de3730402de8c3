"""``deepspeed.utils.zero_to_fp32`` on zkit: DeepSpeed's functions over a real DeepSpeed
checkpoint give what DeepSpeed's own give (state dict, files, shard names, index), and over a
zkit checkpoint what ``zkit consolidate`` gives; DeepSpeed's file helpers answer for a zkit
checkpoint the way Lightning reads them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zkit
from zkit.checkpoint import consolidate
from deepspeed.utils import zero_to_fp32 as z2f

#: DeepSpeed's checkpoints the comparison converts (``test_deepspeed_checkpoint_import``'s runs)
RUNS = ("2-fp32", "3-fp32")


def deepspeeds_conversion_argv(root: Path) -> list[str]:
    """The command of DeepSpeed's own conversions of the runs' checkpoints, into ``<run>.converted/``
    (``test_deepspeed_checkpoint_import`` runs it after DeepSpeed's training run)."""
    from test_deepspeed_checkpoint_import import HERE, PEER_PYTHON

    return [str(PEER_PYTHON), str(HERE / "deepspeed_peer_zero_to_fp32.py"), *(str(root / run) for run in RUNS)]


def _files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            out[path.name] = load_file(path)
        elif path.suffix == ".bin":
            out[path.name] = torch.load(path, weights_only=True)
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def check_against_deepspeed(root: Path, run: str, ours: Path) -> None:
    """zkit's functions on DeepSpeed's checkpoint ``root/run`` write what DeepSpeed's wrote into
    ``root/<run>.converted`` (called by ``test_deepspeed_checkpoint_import``, whose fixture
    trains the DeepSpeed runs)."""
    deepspeed_side, theirs = root, root / f"{run}.converted"
    _same(z2f.get_fp32_state_dict_from_zero_checkpoint(deepspeed_side / run),
          torch.load(theirs / "fp32.pt", weights_only=True))
    z2f.convert_zero_checkpoint_to_fp32_state_dict(deepspeed_side / run, ours / "bin")
    z2f.convert_zero_checkpoint_to_fp32_state_dict(deepspeed_side / run, ours / "sharded", max_shard_size=500)
    z2f.convert_zero_checkpoint_to_fp32_state_dict(deepspeed_side / run, ours / "safetensors", max_shard_size=500,
                                                   safe_serialization=True)
    for kind in ("bin", "sharded", "safetensors"):
        assert sorted(p.name for p in (ours / kind).iterdir()) == sorted(p.name for p in (theirs / kind).iterdir())
        got, want = _files(ours / kind), _files(theirs / kind)
        assert list(got) == list(want) and len(want) >= (1 if kind == "bin" else 2)
        for fname in want:
            if kind == "safetensors":  # a name -> bytes map; safetensors' writer sorts it, zkit's keeps the order
                got[fname], want[fname] = dict(sorted(got[fname].items())), dict(sorted(want[fname].items()))
            _same(got[fname], want[fname])
        for index in (ours / kind).glob("*.index.json"):
            assert json.loads(index.read_text()) == json.loads((theirs / kind / index.name).read_text())


class Tied(torch.nn.Module):
    """An embedding tied to the output head, a frozen layer and a buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor([3], dtype=torch.int64))

    def forward(self, ids):
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.frozen(self.emb(ids)))).flatten(0, 1),
                                                 ids.flatten())


@pytest.fixture(scope="module")
def zkit_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zkit_z2f")
    model = Tied()
    engine, *_ = zkit.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                 config={"train_batch_size": 2, "zero_optimization": {"stage": 2},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(ids))
        engine.step()
    engine.save_checkpoint(str(root), client_state={"epoch": 7, "loops": {"fit": 1}})
    return root


def test_zkit_checkpoint_gives_the_consolidated_state_dict(zkit_checkpoint, tmp_path):
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(zkit_checkpoint, lazy_mode=True)
    want = torch.load(consolidate(zkit_checkpoint, tmp_path / "c.pt"), weights_only=True)
    _same(state, want)
    assert list(state) == list(Tied().state_dict())
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()  # tied stays tied
    lean = z2f.get_fp32_state_dict_from_zero_checkpoint(zkit_checkpoint, exclude_frozen_parameters=True)
    assert list(lean) == ["steps", "emb.weight", "head.weight"]

    model = z2f.load_state_dict_from_zero_checkpoint(Tied(), zkit_checkpoint)
    _same(model.state_dict(), want)

    z2f.convert_zero_checkpoint_to_fp32_state_dict(zkit_checkpoint, tmp_path / "out", max_shard_size=None,
                                                   exclude_frozen_parameters=True)
    assert sorted(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)) == \
        ["emb.weight", "head.weight", "steps"]


def test_deepspeed_file_helpers_answer_for_a_zkit_checkpoint(zkit_checkpoint):
    """What Lightning's convert_zero_checkpoint_to_fp32_state_dict reads besides the weights."""
    where = zkit_checkpoint / (zkit_checkpoint / "latest").read_text().strip()
    optim = torch.load(z2f.get_optim_files(where)[0], weights_only=False)
    assert optim["optimizer_state_dict"]["zero_stage"] == 2
    model_file = z2f.get_model_state_file(where, 2)
    assert Path(model_file).name == "mp_rank_00_model_states.pt"
    client = torch.load(model_file, weights_only=False)
    assert client["epoch"] == 7 and client["loops"] == {"fit": 1} and client["global_steps"] == 2


def test_bad_inputs_raise_deepspeeds_errors(zkit_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="Unable to find 'latest' file at"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="Directory '.*nope' doesn't exist"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(zkit_checkpoint, tag="nope")
    with pytest.raises(ValueError, match="Unsupported output dtype 'int8'. Choose one of: bf16, bfloat16"):
        z2f.convert_zero_checkpoint_to_state_dict(zkit_checkpoint, tmp_path / "o", dtype="int8")
    with pytest.raises(FileNotFoundError, match="can't find model states file at"):
        z2f.get_model_state_file(tmp_path, 3)
