"""The GPT model zoo entry and the byte-level text dataset."""
from __future__ import annotations

import re
import gzip
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit.data import ByteTextDataset, decode, encode
from zkit.models import GPT, GPTConfig
from zkit.models.gpt import PRESETS
from zkit.core.plugin_manager import PluginError

CORPUS = os.path.join(os.path.dirname(__file__), "..", "contrib", "examples", "data", "austen.txt.gz")
TINY = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**TINY))


# -- model -------------------------------------------------------------------------------------


def test_forward_backward_shapes(model):
    x = torch.randint(0, 256, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 256)
    loss = model(x, torch.randint(0, 256, (3, 16)))
    assert loss.dim() == 0 and loss.item() == pytest.approx(5.545, abs=0.2)  # ~ln(256) at init
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter sequences work


def test_blocks_are_a_module_list(model):
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_tied_embedding_is_one_parameter(model):
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    shared = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert shared.count("lm_head.weight") == 1  # reachable from both modules
    assert model.num_parameters() == GPTConfig(**TINY).num_parameters()
    untied = GPT(GPTConfig(**TINY, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == model.num_parameters() + 256 * 32
    # Both run the same matmuls, so the same FLOPs per token.
    assert untied.flops_per_token() == model.flops_per_token() == 6 * (model.num_parameters() - 16 * 32) + 12 * 2 * 32 * 16


def test_loss_decreases_in_a_few_steps(model):
    torch.manual_seed(0)
    data = ByteTextDataset(CORPUS, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = [data[i] for i in range(8)]
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    losses = []
    for _ in range(15):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_ignore_index_and_labels_are_not_shifted(model):
    x = torch.randint(0, 256, (2, 16))
    labels = x.clone()
    labels[:, 8:] = -100
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, 256), x[:, :8].reshape(-1))
    torch.testing.assert_close(model(x, labels), expected)


def test_causality(model):
    model.eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])


def test_generate_greedy_is_deterministic_and_crops_context(model):
    prompt = encode("Emma")[None]
    a = model.generate(prompt, 20)
    b = model.generate(prompt, 20)
    assert a.shape == (1, 24) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    assert model.training  # mode restored
    sampled = model.generate(prompt, 5, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (1, 9)


def test_attention_is_built_through_the_plugin_family():
    model = GPT(GPTConfig(**TINY, attention="full"))
    assert type(model.blocks[0].attn.core).__name__ == "DenseAttention"
    with pytest.raises(PluginError, match="unknown attention 'nonesuch'"):
        GPT(GPTConfig(**TINY, attention="nonesuch"))
    with pytest.raises(TypeError, match="dense attention does not take option\\(s\\) block"):
        GPT(GPTConfig(**TINY, attention_kwargs={"block": 16}))


def test_presets():
    tiny = GPTConfig.preset("tiny")
    assert 150_000 < tiny.num_parameters() < 250_000
    assert 1_000_000 < GPTConfig.preset("mini").num_parameters() < 2_000_000
    assert 4_000_000 < GPTConfig.preset("small").num_parameters() < 10_000_000
    assert GPTConfig.preset("gpt2-124m").num_parameters() == 124_439_808  # GPT-2 small's known count
    assert GPTConfig.preset("tiny", n_layer=3, attention="dense").n_layer == 3
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m"}
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'; presets: tiny, mini, small"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize(
    "override, message",
    [
        ({"d_model": 30}, r"GPTConfig.d_model \(30\) must be a multiple of n_head \(4\)"),
        ({"n_layer": 0}, "GPTConfig.n_layer must be a positive integer, got 0"),
        ({"vocab_size": 2.5}, "GPTConfig.vocab_size must be a positive integer, got 2.5"),
        ({"dropout": 1.0}, r"GPTConfig.dropout must be in \[0, 1\), got 1.0"),
        ({"attention": ""}, "GPTConfig.attention must be an attention name"),
    ],
)
def test_config_errors(override, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**TINY, "n_head": 4, **override})


def test_forward_errors(model):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(16,\)"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the model's seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must have input_ids' shape \(1, 16\), got \(1, 15\)"):
        model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), -1)


# -- data --------------------------------------------------------------------------------------


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 4)  # 1024 bytes, byte i at offset i
    return path


def test_windows_are_shifted_pairs(text_file):
    ds = ByteTextDataset(text_file, seq_len=10, val_fraction=0.25)
    x, y = ds[3]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (10,)
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    assert len(ds) == (768 - 11) // 10 + 1
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])


def test_pickles_without_its_bytes(text_file):
    import pickle

    ds = ByteTextDataset(text_file, seq_len=10, split="val", val_fraction=0.25)
    blob = pickle.dumps(ds)
    assert len(blob) < 512  # the path and settings only
    copy = pickle.loads(blob)
    assert len(copy) == len(ds) and torch.equal(copy[2][1], ds[2][1])


def test_gzip_and_plain_files_give_the_same_windows(text_file, tmp_path):
    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(gzip.compress(text_file.read_bytes()))
    a, b = ByteTextDataset(text_file, 12, stride=5), ByteTextDataset(gz, 12, stride=5)
    assert len(a) == len(b)
    for i in (0, 7, len(a) - 1):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])


@settings(max_examples=30, deadline=None)
@given(
    seq_len=st.integers(1, 16),
    stride=st.integers(1, 20),
    val_fraction=st.floats(0.05, 0.5),
    data=st.data(),
)
def test_property_split_is_disjoint_and_deterministic(tmp_path_factory, seq_len, stride, val_fraction, data):
    # Large enough that both splits hold at least one window.
    size = data.draw(st.integers(int((seq_len + 2) / val_fraction) + seq_len + 2, 800))
    path = tmp_path_factory.mktemp("c") / "c.txt"
    # Each byte value is its position mod 251 (prime), so windows reveal where they came from.
    path.write_bytes(bytes(i % 251 for i in range(size)))
    train = ByteTextDataset(path, seq_len, "train", val_fraction, stride)
    val = ByteTextDataset(path, seq_len, "val", val_fraction, stride)
    boundary = len(train.data)
    assert boundary + len(val.data) == size
    i = data.draw(st.integers(0, len(train) - 1))
    start = train.window_start(i)
    # Inputs and labels of a training window lie strictly before the validation bytes.
    assert start + seq_len + 1 <= boundary
    x, y = train[i]
    assert x.tolist() == [(start + t) % 251 for t in range(seq_len)]
    assert y.tolist() == [(start + t + 1) % 251 for t in range(seq_len)]
    assert torch.equal(train[i][0], ByteTextDataset(path, seq_len, "train", val_fraction, stride)[i][0])
    j = data.draw(st.integers(0, len(val) - 1))
    assert val[j][0][0].item() == (boundary + val.window_start(j)) % 251
    assert len(train) == (boundary - seq_len - 1) // stride + 1


def test_shipped_corpus():
    train = ByteTextDataset(CORPUS, 128, "train")
    val = ByteTextDataset(CORPUS, 128, "val")
    assert len(train.data) + len(val.data) == 4_025_044
    assert decode(train[0][0]).startswith("SENSE AND SENSIBILITY")
    assert "Anne" in decode(torch.cat([val[i][0] for i in range(50)]))  # Persuasion's heroine


def test_encode_decode_round_trip():
    assert decode(encode("Mr. Darcy — £5")) == "Mr. Darcy — £5"
    assert decode([0xE2, 0x80]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"seq_len": 0}, ValueError, "seq_len must be a positive integer, got 0"),
        ({"seq_len": 8, "split": "test"}, ValueError, "split must be 'train' or 'val', got 'test'"),
        ({"seq_len": 8, "val_fraction": 1.0}, ValueError, r"val_fraction must be between 0 and 1 \(exclusive\), got 1.0"),
        ({"seq_len": 8, "stride": 0}, ValueError, "stride must be a positive integer, got 0"),
        ({"seq_len": 2000}, ValueError, "has 768 bytes, fewer than seq_len \\+ 1 = 2001"),
    ],
)
def test_dataset_errors(text_file, kwargs, error, message):
    with pytest.raises(error, match=message):
        ByteTextDataset(text_file, val_fraction=kwargs.pop("val_fraction", 0.25), **kwargs)


def test_dataset_missing_file_and_bad_index(text_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="text corpus .*missing.txt' does not exist"):
        ByteTextDataset(tmp_path / "missing.txt", 8)
    ds = ByteTextDataset(text_file, 8)
    with pytest.raises(IndexError, match=f"index {len(ds)} out of range for a train split of {len(ds)} windows"):
        ds[len(ds)]


# -- the example job ---------------------------------------------------------------------------


@pytest.mark.slow
def test_train_gpt_example_runs(tmp_path):
    """contrib/examples/train_gpt.py end to end on one process: a few steps of the tiny model."""
    import json
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    script = os.path.join(root, "contrib", "examples", "train_gpt.py")
    with open(os.path.join(root, "contrib", "examples", "configs", "gpt_zero0.json")) as f:
        settings = json.load(f)
    settings["steps_per_print"] = 1
    config = tmp_path / "config.json"
    config.write_text(json.dumps(settings))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run(
        [sys.executable, script, "--config", config, "--steps", "3", "--preset", "tiny",
         "--eval-batches", "1", "--sample-bytes", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained 3 steps" in result.stdout and "validation loss" in result.stdout
    assert "sample (greedy, 8 bytes)" in result.stdout
    assert "train 3/3 (100%)" in result.stderr  # the plain progress line: stderr is not a terminal
    assert re.search(r"step 3(/3)? \| loss", result.stdout + result.stderr)  # the engine's log line
    rows = (tmp_path / "runs" / "gpt_zero0" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,tag,value"
    assert any(row.startswith("3,Train/loss,") for row in rows)
    assert (tmp_path / "runs" / "gpt_zero0" / "checkpoints").is_dir()
