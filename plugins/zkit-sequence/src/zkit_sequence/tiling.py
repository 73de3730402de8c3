"""ALST's memory pieces: work on a long sequence in chunks of tokens, each recomputed in backward.

* :class:`TiledMLP` runs a position-wise module (an MLP) over ``tiles`` chunks of the sequence
  under torch's non-reentrant checkpoint: the ``[tokens, 4 x hidden]`` intermediates of one chunk
  exist at a time, in forward and in backward.
* :func:`tiled_logits_loss_sum` applies the LM head and sums the cross-entropy chunk by chunk the
  same way: the ``[tokens, vocab]`` logits never exist whole.

Both compute what the untiled module computes, element for element; the sums over chunks round in
another order (about 1e-7 relative in fp32). The gradients reach each weight once per backward (the
recomputation replays the recorded graph), so ZeRO's per-parameter reduction hooks fire as usual.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _check_tiles(tiles: Any) -> int:
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles must be a positive int, got {tiles!r}")
    return tiles


class TiledMLP(nn.Module):
    """``module`` (position-wise: each token's output depends on that token alone) over ``tiles``
    chunks of the sequence dimension ``dim`` (default -2 of ``[..., seq, hidden]``)."""

    def __init__(self, module: nn.Module, tiles: int, dim: int = -2) -> None:
        super().__init__()
        self.module = module
        self.tiles = _check_tiles(tiles)
        self.dim = dim

    def extra_repr(self) -> str:
        return f"tiles={self.tiles}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles == 1:
            return self.module(x)
        chunks = x.chunk(self.tiles, dim=self.dim)
        return torch.cat([checkpoint(self.module, c, use_reentrant=False) for c in chunks], dim=self.dim)


def logits_loss_sum(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy (in fp32) of ``head(hidden)`` against ``target`` (``-100`` ignored)."""
    return F.cross_entropy(head(hidden).float(), target, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_logits_loss_sum(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, tiles: int) -> torch.Tensor:
    """:func:`logits_loss_sum` of ``hidden`` (``[tokens, hidden]``) and ``target`` (``[tokens]``)
    over ``tiles`` chunks of tokens, each chunk's logits recomputed in backward. The head is called
    as a module, so a partitioner that gathers its weight around its forward (ZeRO-3) gathers it for
    each chunk and its recomputation."""
    _check_tiles(tiles)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.chunk(tiles, dim=0), target.chunk(tiles, dim=0)):
        total = total + checkpoint(logits_loss_sum, head, h, t, use_reentrant=False)
    return total
