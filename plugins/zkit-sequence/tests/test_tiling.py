"""ALST's tiled MLP and tiled logits + loss equal the untiled computation, and the tiled loss never
holds the whole ``[tokens, vocab]`` logits."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sequence_ranks as sr
from zkit_sequence import SequenceParallelCrossEntropy, TiledMLP, tiled_logits_loss_sum
from zkit_sequence.tiling import logits_loss_sum


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tiles", [2, 3, 8])
def test_tiled_mlp_equals_the_untiled_mlp(tiles):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(2, 30, 16, requires_grad=True)
    want = mlp(x)
    want.square().sum().backward()
    want_grads, want_x = _grads(mlp), x.grad.clone()
    mlp.zero_grad()
    x.grad = None
    got = TiledMLP(mlp, tiles)(x)
    got.square().sum().backward()
    assert _rel(got, want) < 1e-6 and _rel(x.grad, want_x) < 1e-6
    for name, g in _grads(mlp).items():
        assert _rel(g, want_grads[name]) < 1e-6, name


class LargestTensor(TorchDispatchMode):
    """The most elements any operation's result holds (forward and backward: on the CPU autograd
    runs the backward on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("tiles", [1, 4])
def test_tiled_logits_loss_equals_the_untiled_loss_and_never_holds_all_logits(tiles):
    torch.manual_seed(0)
    tokens, hidden, vocab = 64, 8, 512
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    target[5:20] = -100
    want = torch.nn.functional.cross_entropy(head(h), target, ignore_index=-100, reduction="sum")
    want.backward()
    want_w, want_h = head.weight.grad.clone(), h.grad.clone()
    head.zero_grad()
    h.grad = None
    with LargestTensor() as seen:
        got = tiled_logits_loss_sum(head, h, target, tiles) if tiles > 1 else logits_loss_sum(head, h, target)
        got.backward()
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    assert _rel(head.weight.grad, want_w) < 1e-6 and _rel(h.grad, want_h) < 1e-6
    if tiles > 1:
        assert seen.largest <= tokens * vocab // tiles  # one chunk's logits at a time
    else:
        assert seen.largest == tokens * vocab


def test_a_chunk_of_ignored_tokens_adds_nothing():
    head = torch.nn.Linear(4, 10, bias=False)
    h = torch.randn(8, 4, requires_grad=True)
    target = torch.full((8,), -100)
    target[:2] = 3
    got = tiled_logits_loss_sum(head, h, target, 4)
    assert torch.isfinite(got) and got.item() == pytest.approx(logits_loss_sum(head, h, target).item(), rel=1e-6)


def test_the_model_with_tiling_equals_the_model_without():
    x, y = sr.rank_batch(0, 0, 2)
    plain, tiled = sr.build(), sr.build(mlp_tiles=4, loss_tiles=4)
    want, got = plain(x, y), tiled(x, y)
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    tiled_grads = dict(tiled.named_parameters())
    for name, p in plain.named_parameters():
        assert _rel(tiled_grads[name].grad, p.grad) < 1e-5, name


@pytest.mark.parametrize("make", [lambda: TiledMLP(torch.nn.Identity(), 0), lambda: SequenceParallelCrossEntropy(1.5),
                                  lambda: tiled_logits_loss_sum(torch.nn.Identity(), torch.zeros(2, 2),
                                                                torch.zeros(2, dtype=torch.long), -1)])
def test_bad_tile_counts_are_refused(make):
    with pytest.raises(ValueError, match="tiles must be a positive int"):
        make()
